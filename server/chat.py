"""POST /v1/chat/completions."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from fastapi import APIRouter, Request
from starlette.responses import Response

from pagedserve.engine import CompletionOutput, SequenceDelta, TokenLogprob
from pagedserve.server.context import ServingContext, serving
from pagedserve.server.errors import to_api_error
from pagedserve.server.generation import collect, start_streams, unless_disconnected
from pagedserve.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Usage,
)
from pagedserve.server.sse import sse_events, sse_response

logger = logging.getLogger(__name__)
router = APIRouter(tags=["openai"])


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletion:
    ctx = serving(request)
    ctx.check_model(body.model)
    engine = ctx.ready_engine()
    try:
        params = body.sampling_params()
        prompt = await engine.encode_chat(
            body.template_messages(), body.add_generation_prompt, body.continue_final_message
        )
    except ValueError as exc:
        raise to_api_error(exc, "messages") from exc
    request_id, record = request.state.request_id, request.state.record
    streams = await start_streams(engine, ctx.engine_request_id(request_id), [prompt], params, "messages", body.timeout)
    logger.debug("request %s: chat, %d prompt tokens, n=%d, stream=%s", request_id, len(prompt), params.n, body.stream)
    reply = ChatReply(ctx, body)
    record.prompt_tokens = len(prompt)
    if body.stream:
        events = sse_events(reply, streams, params.n, record, body.include_usage)
        return sse_response(events, streams)
    outputs = await unless_disconnected(request, collect(streams, params.n, record))
    return reply.completion(outputs, record.usage())


class ChatReply:
    """Builds the answer's objects; also the ChunkFormatter for streaming."""

    def __init__(self, ctx: ServingContext, body: ChatCompletionRequest) -> None:
        self._ctx = ctx
        self._n = body.n
        self._prompt_logprobs = body.prompt_logprobs is not None
        self._envelope = ctx.envelope("chatcmpl")

    def completion(self, outputs: list[CompletionOutput], usage: Usage) -> ChatCompletion:
        choices = [
            ChatChoice(
                index=output.index,
                message=AssistantMessage(content=output.text),
                logprobs=self._logprobs(output.logprobs),
                finish_reason=output.finish_reason,
            )
            for output in outputs
        ]
        prompt = outputs[0].prompt_logprobs if self._prompt_logprobs and outputs else None
        scored = None if prompt is None else vllm_prompt_logprobs(prompt, self._ctx.token_texts)
        return ChatCompletion(**self._envelope, choices=choices, usage=usage, prompt_logprobs=scored)

    def opening(self) -> Iterable[ChatCompletionChunk]:
        role = {"role": "assistant", "content": ""}
        return [self._chunk(ChatChunkChoice(index=i, delta=role)) for i in range(self._n)]

    def on_delta(self, choice: int, delta: SequenceDelta) -> ChatCompletionChunk | None:
        if not delta.new_text and not delta.new_logprobs:
            return None
        content, logprobs = {"content": delta.new_text}, self._logprobs(delta.new_logprobs)
        return self._chunk(ChatChunkChoice(index=choice, delta=content, logprobs=logprobs))

    def on_finish(self, choice: int, finish_reason: str) -> ChatCompletionChunk:
        return self._chunk(ChatChunkChoice(index=choice, delta={}, finish_reason=finish_reason))

    def on_usage(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._envelope, choices=[], usage=usage)

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._envelope, choices=[choice])

    def _logprobs(self, items: list[TokenLogprob] | None) -> ChatLogprobs | None:
        return None if items is None else chat_logprobs(items, self._ctx.token_texts)
