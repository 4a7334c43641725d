"""POST /v1/responses: OpenAI's Responses API, stateless, one assistant message per response.

Streamed, the events come in OpenAI's order: response.created, response.in_progress, output_item.added,
content_part.added, one output_text.delta per text delta, output_text.done, content_part.done,
output_item.done, then response.completed (or response.incomplete at the length limit). A stream that fails
after it started ends with an `error` event carrying the same code as an HTTP error would, then
response.failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from pagedserve.engine import CompletionOutput, SamplingParams, SequenceDelta, TokenLogprob
from pagedserve.server.context import ServingContext, serving
from pagedserve.server.errors import APIError, as_api_error, to_api_error
from pagedserve.server.generation import Streams, collect, recorded, start_streams, unless_disconnected
from pagedserve.server.logprobs import chat_logprobs
from pagedserve.server.logs import RequestRecord
from pagedserve.server.responses import ChatTokenLogprob, Usage
from pagedserve.server.responses_protocol import (
    ContentPartEvent,
    ErrorEvent,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    LifecycleEvent,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    Status,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from pagedserve.server.sse import Event, sse_response

logger = logging.getLogger(__name__)
router = APIRouter(tags=["openai"])

# Engine messages name SamplingParams' fields; this API spells this one differently.
_RENAMED = {"max_tokens": "max_output_tokens"}
_STATUS: dict[str, Status] = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}
_ITEM_STATUS: dict[Status, ItemStatus] = {"in_progress": "in_progress", "completed": "completed"}


@router.post("/v1/responses", response_model=ResponseObject)
async def create_response(body: ResponsesRequest, request: Request) -> Response | ResponseObject:
    ctx = serving(request)
    ctx.check_model(body.model)
    engine = ctx.ready_engine()
    try:
        params = body.sampling_params()
        prompt = await engine.encode_chat(body.template_messages())
    except ValueError as exc:
        raise _renamed(to_api_error(exc, "input")) from exc
    request_id, record = request.state.request_id, request.state.record
    engine_id = ctx.engine_request_id(request_id)
    try:
        streams = await start_streams(engine, engine_id, [prompt], params, "input", body.timeout)
    except APIError as error:
        _renamed(error)
        raise
    logger.debug("request %s: response, %d prompt tokens, stream=%s", request_id, len(prompt), body.stream)
    record.prompt_tokens = len(prompt)
    reply = ResponseReply(ctx, body, params)
    if body.stream:
        return sse_response(response_events(reply, streams, record), streams)
    [output] = await unless_disconnected(request, collect(streams, 1, record))
    return reply.complete(output, record.usage())


def _renamed(error: APIError) -> APIError:
    if error.param is not None and error.param in _RENAMED:
        name = _RENAMED[error.param]
        error.message = error.message.replace(error.param, name, 1)
        error.param = name
    return error


def response_usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )


class ResponseReply:
    """One response as it is generated: its text so far, and the objects built from it."""

    def __init__(self, ctx: ServingContext, body: ResponsesRequest, params: SamplingParams) -> None:
        self._ctx = ctx
        self._body = body
        self._params = params
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.text = ""
        self.logprobs: list[ChatTokenLogprob] = []
        self.finish_reason: str | None = None

    @property
    def where(self) -> dict[str, Any]:
        """Where the text goes: the one message's one part."""
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def add(self, delta: SequenceDelta) -> list[ChatTokenLogprob]:
        """Takes in a delta; returns its logprobs in the API's shape (empty unless asked for)."""
        logprobs = self._logprobs(delta.new_logprobs)
        self.text += delta.new_text
        self.logprobs += logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        return logprobs

    def complete(self, output: CompletionOutput, usage: Usage) -> ResponseObject:
        """The whole answer, from a collected output."""
        self.text, self.finish_reason = output.text, output.finish_reason
        self.logprobs = self._logprobs(output.logprobs)
        return self.finished(usage)

    def finished(self, usage: Usage) -> ResponseObject:
        status = _STATUS.get(self.finish_reason or "stop", "completed")
        return self.response(status, [self.message(status)], response_usage(usage))

    def failed(self, error: APIError) -> ResponseObject:
        """What was generated before the failure stays in the output."""
        failure = ResponseError(code=error.code, message=error.message)
        return self.response("failed", [self.message("failed")], error=failure)

    def response(
        self,
        status: Status,
        output: list[OutputMessage] | None = None,
        usage: ResponseUsage | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        body, params = self._body, self._params
        length_limited = status == "incomplete" and self.finish_reason == "length"
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            completed_at=int(time.time()) if status in ("completed", "incomplete") else None,
            status=status,
            error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if length_limited else None,
            model=self._ctx.model_name,
            output=output or [],
            usage=usage,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_logprobs=body.top_logprobs,
            metadata=body.metadata or {},
            parallel_tool_calls=body.parallel_tool_calls,
            tool_choice=body.tool_choice,
            user=body.user,
        )

    def message(self, status: Status, content: list[OutputText] | None = None) -> OutputMessage:
        """The assistant message: with the text so far unless `content` is given."""
        parts = [self.part()] if content is None else content
        return OutputMessage(id=self.message_id, status=_ITEM_STATUS.get(status, "incomplete"), content=parts)

    def part(self) -> OutputText:
        return OutputText(text=self.text, logprobs=self.logprobs)

    def _logprobs(self, items: list[TokenLogprob] | None) -> list[ChatTokenLogprob]:
        return [] if items is None else chat_logprobs(items, self._ctx.token_texts).content


async def response_events(reply: ResponseReply, streams: Streams, record: RequestRecord) -> AsyncIterator[Event]:
    numbers = itertools.count()

    def event(model: type[StreamEvent], kind: str, **fields: Any) -> Event:
        payload = model(type=kind, sequence_number=next(numbers), **fields)
        return {"event": kind, "data": payload.model_dump_json()}

    yield event(LifecycleEvent, "response.created", response=reply.response("in_progress"))
    yield event(LifecycleEvent, "response.in_progress", response=reply.response("in_progress"))
    yield event(OutputItemEvent, "response.output_item.added", output_index=0, item=reply.message("in_progress", []))
    yield event(ContentPartEvent, "response.content_part.added", **reply.where, part=OutputText(text=""))
    try:
        async with contextlib.aclosing(recorded(streams, record)) as deltas:
            async for _, delta in deltas:
                logprobs = reply.add(delta)
                if delta.new_text or logprobs:
                    text_delta = {"delta": delta.new_text, "logprobs": logprobs}
                    yield event(TextDeltaEvent, "response.output_text.delta", **reply.where, **text_delta)
    except asyncio.CancelledError:  # the client hung up: the stream is being torn down
        record.error_code = "client_closed"
        raise
    except Exception as exc:
        error = as_api_error(exc)
        record.error_code = error.code
        yield event(ErrorEvent, "error", code=error.code, message=error.message, param=error.param)
        yield event(LifecycleEvent, "response.failed", response=reply.failed(error))
        return
    final = reply.finished(record.usage())
    yield event(TextDoneEvent, "response.output_text.done", **reply.where, text=reply.text, logprobs=reply.logprobs)
    yield event(ContentPartEvent, "response.content_part.done", **reply.where, part=reply.part())
    yield event(OutputItemEvent, "response.output_item.done", output_index=0, item=final.output[0])
    yield event(LifecycleEvent, f"response.{final.status}", response=final)
