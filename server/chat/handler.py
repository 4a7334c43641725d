"""POST /v1/chat/completions."""

from __future__ import annotations

import dataclasses
import logging

from fastapi import APIRouter, Request
from starlette.responses import Response

from pagedserve.server.answers import json_answer
from pagedserve.server.chat.protocol import ChatCompletion, ChatCompletionRequest
from pagedserve.server.chat.reply import ChatReply
from pagedserve.server.generation import Generation
from pagedserve.server.reasoning import prompt_opens_reasoning
from pagedserve.server.response_format import naming_constraint_errors
from pagedserve.server.sse import sse_events, sse_response

logger = logging.getLogger(__name__)
router = APIRouter(tags=["openai"])
PROMPT_TAIL_TOKENS = 4  # enough to see whether the prompt ends by opening a think block


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletion:
    call = Generation(request, body.model)
    ctx, engine, record = call.ctx, call.engine, call.record
    with call.client_errors("messages"):
        tools = body.tool_plan(ctx.tool_call_parser)
        params = body.sampling_params(tools)
        prompt = await engine.encode_chat(
            body.template_messages(),
            body.add_generation_prompt,
            body.continue_final_message,
            body.template_tools(),
            body.chat_template_kwargs,
            body.add_special_tokens,
        )
    thinks = ctx.splits_reasoning and prompt_opens_reasoning(engine.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:]))
    if ctx.splits_reasoning and params.structured_output is not None:  # the constraint is on the answer only
        constraint = params.structured_output.after_thinking(opened=thinks)
        params = dataclasses.replace(params, structured_output=constraint)
    with naming_constraint_errors(body.constraint_param(tools)):
        streams = await call.start([prompt], params, "messages", body.timeout)
    logger.debug(
        "request %s: chat, %d prompt tokens, n=%d, stream=%s", call.request_id, len(prompt), params.n, body.stream
    )
    reply = ChatReply(ctx, body, tools, thinks, prompt)
    if body.stream:
        return sse_response(
            sse_events(reply, streams, params.n, record, body.include_usage, body.continuous_usage), streams
        )
    outputs = await call.collect(streams, params.n)
    usage = record.usage()
    return await json_answer(lambda: reply.completion(outputs, usage))
