"""POST /v1/responses: OpenAI's Responses API, stateless. The output is an assistant message, function calls,
or a message followed by calls.

Streamed, the events come in OpenAI's order: response.created, response.in_progress; for a message
output_item.added, content_part.added, one output_text.delta per text delta, output_text.done,
content_part.done, output_item.done; for a function call output_item.added, function_call_arguments.delta
fragments, function_call_arguments.done, output_item.done; then response.completed (or response.incomplete at
the length limit). Without tools the message is opened at once; with tools, when its first text comes. A
stream that fails after it started ends with an `error` event carrying the same code as an HTTP error would,
then response.failed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import Response

from pagedserve.server.errors import APIError
from pagedserve.server.generation import Generation, Streams, recorded
from pagedserve.server.request_log import RequestRecord
from pagedserve.server.response_format import naming_constraint_errors
from pagedserve.server.responses.output import ErrorEvent, LifecycleEvent, ResponseObject
from pagedserve.server.responses.protocol import ResponsesRequest
from pagedserve.server.responses.reply import EventSpec, ResponseReply
from pagedserve.server.sse import Event, failure_recorded, sse_response

logger = logging.getLogger(__name__)
router = APIRouter(tags=["openai"])

# Engine messages name SamplingParams' fields; this API spells this one differently.
_RENAMED = {"max_tokens": "max_output_tokens"}


@router.post("/v1/responses", response_model=ResponseObject)
async def create_response(body: ResponsesRequest, request: Request) -> Response | ResponseObject:
    call = Generation(request, body.model, restate=_renamed)
    record = call.record
    with call.client_errors("input"):
        tools = body.tool_plan(call.ctx.tool_call_parser)
        params = body.sampling_params(tools)
        prompt = await call.engine.encode_chat(body.template_messages(), tools=body.template_tools())
    with naming_constraint_errors(body.constraint_param(tools)):
        streams = await call.start([prompt], params, "input", body.timeout)
    logger.debug("request %s: response, %d prompt tokens, stream=%s", call.request_id, len(prompt), body.stream)
    reply = ResponseReply(call.ctx, body, params, tools)
    if body.stream:
        return sse_response(response_events(reply, streams, record), streams)
    [output] = await call.collect(streams, 1)
    return reply.complete(output, record.usage())


def _renamed(error: APIError) -> None:
    if error.param is not None and error.param in _RENAMED:
        name = _RENAMED[error.param]
        error.message = error.message.replace(error.param, name, 1)
        error.param = name


async def response_events(reply: ResponseReply, streams: Streams, record: RequestRecord) -> AsyncIterator[Event]:
    numbers = itertools.count()

    def event(spec: EventSpec) -> Event:
        model, kind, fields = spec
        payload = model(type=kind, sequence_number=next(numbers), **fields)
        return {"event": kind, "data": payload.model_dump_json()}

    yield event((LifecycleEvent, "response.created", {"response": reply.response("in_progress")}))
    yield event((LifecycleEvent, "response.in_progress", {"response": reply.response("in_progress")}))
    for spec in reply.opening():
        yield event(spec)
    with failure_recorded(record) as failure:
        async with contextlib.aclosing(recorded(streams, record)) as deltas:
            async for _, delta in deltas:
                for spec in reply.on_delta(delta):
                    yield event(spec)
    if (error := failure.error) is not None:
        yield event((ErrorEvent, "error", {"code": error.code, "message": error.message, "param": error.param}))
        yield event((LifecycleEvent, "response.failed", {"response": reply.failed(error)}))
        return
    for spec in reply.closing():
        yield event(spec)
    final = reply.finished(record.usage())
    yield event((LifecycleEvent, f"response.{final.status}", {"response": final}))
