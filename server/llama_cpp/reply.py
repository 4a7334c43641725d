"""llama.cpp's /completion answers: the final object (whole, or the last streamed event) and the partial events."""

from __future__ import annotations

from typing import Any

from pagedserve.engine import CompletionOutput, SamplingParams, SequenceDelta, TokenLogprob
from pagedserve.server.context import ServingContext
from pagedserve.server.llama_cpp.protocol import LlamaCompletionRequest
from pagedserve.server.logprobs import MIN_LOGPROB

STOP_TYPES = {"length": "limit", "stop": "eos", "abort": "none"}


class LlamaReply:
    def __init__(
        self, ctx: ServingContext, body: LlamaCompletionRequest, params: SamplingParams, prompts: list[list[int]]
    ) -> None:
        self._ctx = ctx
        self._body = body
        self._params = params
        self._prompts = prompts

    def partial(self, delta: SequenceDelta, prompt_index: int) -> dict[str, Any]:
        event: dict[str, Any] = {
            "index": prompt_index,
            "content": delta.new_text,
            "tokens": delta.new_token_ids,
            "stop": False,
        }
        if delta.new_logprobs is not None:
            event["completion_probabilities"] = self._probabilities(delta.new_logprobs)
        return event

    def final(
        self, output: CompletionOutput, prompt_index: int, streamed: bool = False, cached: int = 0
    ) -> dict[str, Any]:
        """The whole answer; streamed, the last event (its text and tokens came before)."""
        prompt = self._prompts[prompt_index]
        word = output.stop_reason if isinstance(output.stop_reason, str) else ""
        answer: dict[str, Any] = {
            "index": prompt_index,
            "content": "" if streamed else output.text,
            "tokens": output.token_ids if self._body.return_tokens and not streamed else [],
            "stop": True,
            "model": self._ctx.model_name,
            "prompt": self._ctx.engine.tokenizer.decode(prompt),
            "generation_settings": self._body.generation_settings(self._params),
            "tokens_predicted": len(output.token_ids),
            "tokens_evaluated": len(prompt),
            "tokens_cached": cached,
            "has_new_line": "\n" in output.text,
            "truncated": False,  # a prompt over the context is refused, never cut
            "stop_type": "word" if word else STOP_TYPES.get(output.finish_reason or "", "none"),
            "stopping_word": word,
            "timings": self._timings(output, len(prompt), cached),
        }
        if output.logprobs is not None and not streamed:
            answer["completion_probabilities"] = self._probabilities(output.logprobs)
        return _only(answer, self._body.response_fields)

    def _timings(self, output: CompletionOutput, prompt_n: int, cached: int) -> dict[str, Any]:
        timings: dict[str, Any] = {
            "cache_n": cached,
            "prompt_n": prompt_n - cached,
            "predicted_n": len(output.token_ids),
        }
        metrics = output.metrics
        if metrics is not None and metrics.time_to_first_token is not None and metrics.e2e_latency is not None:
            timings["prompt_ms"] = 1000 * (metrics.time_to_first_token - (metrics.queue_time or 0.0))
            timings["predicted_ms"] = 1000 * (metrics.e2e_latency - metrics.time_to_first_token)
        return timings

    def _probabilities(self, items: list[TokenLogprob]) -> list[dict[str, Any]]:
        return [
            {**self._token(item.token_id, item.logprob), "top_logprobs": [self._token(i, lp) for i, lp in item.top]}
            for item in items
        ]

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._ctx.token_text(token_id)
        return {"id": token_id, "token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode())}


def _only(answer: dict[str, Any], fields: list[str] | None) -> dict[str, Any]:
    """llama.cpp's response_fields: only the named fields; `a/b` takes b out of a, named `a/b`; missing ones left
    out."""
    if not fields:
        return answer
    chosen: dict[str, Any] = {}
    for name in fields:
        value: Any = answer
        for part in name.split("/"):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            chosen[name] = value
    return chosen
