"""POST /v1/chat/completions."""

from __future__ import annotations

import dataclasses
import logging

from fastapi import APIRouter, Request
from starlette.responses import Response

from pagedserve.server.bodies import ChatCompletion
from pagedserve.server.chat.reply import ChatReply
from pagedserve.server.context import serving
from pagedserve.server.errors import to_api_error
from pagedserve.server.generation import collect, reserved_place, start_streams, unless_disconnected
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.reasoning import prompt_opens_reasoning
from pagedserve.server.sse import sse_events, sse_response

logger = logging.getLogger(__name__)
router = APIRouter(tags=["openai"])
PROMPT_TAIL_TOKENS = 4  # enough to see whether the prompt ends by opening a think block


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletion:
    ctx = serving(request)
    ctx.check_model(body.model)
    engine = ctx.ready_engine()
    try:
        tools = body.tool_plan(ctx.tool_call_parser)
        params = body.sampling_params(tools)
        prompt = await engine.encode_chat(
            body.template_messages(), body.add_generation_prompt, body.continue_final_message, body.template_tools()
        )
    except ValueError as exc:
        raise to_api_error(exc, "messages") from exc
    thinks = ctx.splits_reasoning and prompt_opens_reasoning(
        str(engine.tokenizer.hf.decode(prompt[-PROMPT_TAIL_TOKENS:]))
    )
    if ctx.splits_reasoning and params.structured_output is not None:  # the constraint is on the answer only
        constraint = params.structured_output.after_thinking(opened=thinks)
        params = dataclasses.replace(params, structured_output=constraint)
    request_id, record = request.state.request_id, request.state.record
    engine_id, reservation = ctx.engine_request_id(request_id), reserved_place(request)
    streams = await start_streams(engine, engine_id, [prompt], params, "messages", body.timeout, reservation)
    logger.debug("request %s: chat, %d prompt tokens, n=%d, stream=%s", request_id, len(prompt), params.n, body.stream)
    reply = ChatReply(ctx, body, tools, thinks)
    record.prompt_tokens = len(prompt)
    if body.stream:
        events = sse_events(reply, streams, params.n, record, body.include_usage)
        return sse_response(events, streams)
    outputs = await unless_disconnected(request, collect(streams, params.n, record))
    return reply.completion(outputs, record.usage())
