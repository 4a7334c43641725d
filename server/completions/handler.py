"""POST /v1/completions: one engine request per prompt, choices indexed prompt-major."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from pagedserve.engine import CompletionOutput, SequenceDelta, TokenLogprob
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.outputs import PromptLogprobs
from pagedserve.engine.validation import check_admissible
from pagedserve.server.answers import json_answer
from pagedserve.server.completions.protocol import Completion, CompletionChoice, CompletionRequest
from pagedserve.server.context import ServingContext
from pagedserve.server.generation import Generation
from pagedserve.server.logprobs import completion_logprobs, echoed_prompt_logprobs, vllm_prompt_logprobs
from pagedserve.server.protocol import CompletionLogprobs, PromptLogprobsOut, Usage
from pagedserve.server.sse import sse_events, sse_response

logger = logging.getLogger(__name__)
router = APIRouter(tags=["openai"])


@router.post("/v1/completions", response_model=Completion)
async def create_completion(body: CompletionRequest, request: Request) -> Response | Completion:
    call = Generation(request, body.model)
    engine, record = call.engine, call.record
    with call.client_errors("prompt"):
        params = body.sampling_params()
        check_admissible(engine.limits, len(body.prompts), params.n)  # before tokenizing: it costs nothing
        prompts = [await engine.encode_prompt(prompt, body.add_special_tokens) for prompt in body.prompts]
    streams = await call.start(prompts, params, "prompt", body.timeout)
    logger.debug(
        "request %s: completion, %d prompts, %d prompt tokens, n=%d, stream=%s",
        call.request_id,
        len(prompts),
        record.prompt_tokens,
        params.n,
        body.stream,
    )
    reply = CompletionReply(call.ctx, body, prompts, _echoes(engine, body, prompts), params.n)
    if body.stream:
        return sse_response(
            sse_events(reply, streams, params.n, record, body.include_usage, body.continuous_usage), streams
        )
    outputs = await call.collect(streams, params.n)
    usage = record.usage()
    return await json_answer(lambda: reply.completion(outputs, usage))


def _echoes(engine: AsyncEngine, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """The text each choice starts with: its prompt with echo, else nothing."""
    if not body.echo:
        return [""] * len(prompts)
    tokenizer = engine.tokenizer
    return [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(body.prompts, prompts)]


class CompletionReply:
    """Builds the answer's objects; also the ChunkFormatter for streaming.

    With echo and logprobs, an echoed prompt's tokens come with their logprobs (the first one null), ahead of
    the generated ones; streamed, the echo then waits for the first delta, which brings them.
    """

    def __init__(
        self, ctx: ServingContext, body: CompletionRequest, prompts: list[list[int]], echoes: list[str], n: int
    ) -> None:
        self._ctx = ctx
        self._n = n
        self._prompts = prompts
        self._echoes = [echo for echo in echoes for _ in range(n)]  # per choice
        self._text_offsets = [len(echo) for echo in self._echoes]  # where each choice's next token starts
        self._echo_logprobs = body.echoes_logprobs
        self._vllm_prompt_logprobs = body.prompt_logprobs is not None
        self._token_ids = body.return_token_ids
        self._prompt_ids_sent: set[int] = set()  # streamed choices whose prompt_token_ids went out
        self._envelope = ctx.envelope("cmpl")

    def completion(self, outputs: list[CompletionOutput], usage: Usage) -> Completion:
        choices = [
            CompletionChoice(
                index=output.index,
                text=self._echoes[output.index] + output.text,
                logprobs=self._choice_logprobs(output.index, output.prompt_logprobs, output.logprobs),
                finish_reason=output.finish_reason,
                prompt_logprobs=self._vllm(output.prompt_logprobs),
                **self._ids(output.index, output.token_ids),
            )
            for output in outputs
        ]
        return Completion(**self._envelope, choices=choices, usage=usage)

    def opening(self) -> Iterable[Completion]:
        if self._echo_logprobs:
            return []  # each echo comes with its prompt's logprobs, in the choice's first delta
        echoes = enumerate(self._echoes)
        return [self._chunk(CompletionChoice(index=i, text=echo)) for i, echo in echoes if echo]

    def on_delta(self, choice: int, delta: SequenceDelta) -> list[Completion]:
        prompt_logprobs = delta.prompt_logprobs
        text = delta.new_text
        if self._echo_logprobs and prompt_logprobs is not None:
            text = self._echoes[choice] + text
        logprobs = self._choice_logprobs(choice, prompt_logprobs, delta.new_logprobs)
        vllm = self._vllm(prompt_logprobs)
        if not text and logprobs is None and vllm is None and not (self._token_ids and delta.new_token_ids):
            return []
        ids = self._ids(choice, delta.new_token_ids)
        return [self._chunk(CompletionChoice(index=choice, text=text, logprobs=logprobs, prompt_logprobs=vllm, **ids))]

    def _ids(self, choice: int, token_ids: list[int]) -> dict[str, Any]:
        """With return_token_ids, a choice's new token ids, and its prompt's the first time (vLLM's fields)."""
        if not self._token_ids:
            return {}
        ids: dict[str, Any] = {"token_ids": token_ids}
        if choice not in self._prompt_ids_sent:
            self._prompt_ids_sent.add(choice)
            ids["prompt_token_ids"] = self._prompts[choice // self._n]
        return ids

    def on_finish(self, choice: int, finish_reason: str) -> list[Completion]:
        return [self._chunk(CompletionChoice(index=choice, text="", finish_reason=finish_reason))]

    def on_usage(self, usage: Usage) -> Completion:
        return Completion(**self._envelope, choices=[], usage=usage)

    def _chunk(self, choice: CompletionChoice) -> Completion:
        return Completion(**self._envelope, choices=[choice])

    def _choice_logprobs(
        self, choice: int, prompt: PromptLogprobs | None, generated: list[TokenLogprob] | None
    ) -> CompletionLogprobs | None:
        """The generated tokens' logprobs, after the echoed prompt's when those are due."""
        tail = self._generated_logprobs(choice, generated)
        if not (self._echo_logprobs and prompt is not None):
            return tail
        head = echoed_prompt_logprobs(self._prompts[choice // self._n], prompt, self._ctx.token_text)
        if tail is not None:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(head, name).extend(getattr(tail, name))
        return head

    def _generated_logprobs(self, choice: int, items: list[TokenLogprob] | None) -> CompletionLogprobs | None:
        if items is None:
            return None
        logprobs = completion_logprobs(items, self._ctx.token_text, self._text_offsets[choice])
        if logprobs.tokens:
            self._text_offsets[choice] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        return logprobs

    def _vllm(self, prompt: PromptLogprobs | None) -> PromptLogprobsOut | None:
        if not self._vllm_prompt_logprobs or prompt is None:
            return None
        return vllm_prompt_logprobs(prompt, self._ctx.token_text)
