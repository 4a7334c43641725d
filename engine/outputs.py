"""What the engine hands back: per-step deltas for streaming, whole results for the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # the most likely tokens, best first
    rank: int | None = None  # 1 = the most likely token; given with prompt logprobs


PromptLogprobs = list[TokenLogprob | None]  # one per prompt token; the first is None (nothing precedes it)


def scored_positions(num_computed: int, num_new: int, num_scored: int, num_prompt_tokens: int) -> range:
    """The positions whose prompt logprob a step computing positions [num_computed, num_computed + num_new)
    scores: position p's hidden state gives token p + 1's logprob, so the last prompt position (the first
    generated token's) is not among them, nor are positions scored already (`num_scored` tokens, kept across a
    preemption). The scheduler charges them to the step's budget; the worker scores them."""
    first = max(num_computed, num_scored)
    return range(first, max(first, min(num_computed + num_new, num_prompt_tokens - 1)))


@dataclass
class RequestMetrics:
    arrival_time: float
    queue_time: float | None = None  # arrival -> first scheduled
    time_to_first_token: float | None = None  # arrival -> first token
    e2e_latency: float | None = None  # arrival -> finished
    num_preemptions: int = 0


@dataclass
class SequenceDelta:
    """What one of a request's n sequences produced in one step."""

    request_id: str  # the caller's id (shared by the n sequences)
    index: int  # which of the n sequences
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs set: on the sequence's first delta
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token that ended it
    # Set on the finishing delta:
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    metrics: RequestMetrics | None = None

    def extend(self, delta: SequenceDelta) -> None:
        self.text += delta.new_text
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.new_logprobs
        if delta.finished:
            self.finish_reason, self.stop_reason, self.metrics = (
                delta.finish_reason,
                delta.stop_reason,
                delta.metrics,
            )


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
