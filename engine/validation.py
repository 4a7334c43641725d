"""Every check a request must pass before the engine takes it, in one place.

The engine's public API (AsyncEngine.generate, LLM.generate) runs these once, on the caller's side, so bad
input fails at once with a ValueError (ContextLengthError for a prompt that is too long) and the engine core
only ever sees requests it can run. SamplingParams checks what needs no engine (ranges of each field);
these checks need the loaded engine's numbers (RequestLimits).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.sampling_params import SamplingParams


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queue_len: the caller should retry later."""


class ContextLengthError(ValueError):
    """The prompt does not fit the model's context; carries the numbers for the error message."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens (at least one token must be left to generate)."
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


@dataclass(frozen=True)
class RequestLimits:
    """The loaded engine's numbers that bound a request."""

    max_model_len: int  # tokens of context, capped by what the KV cache holds for one request
    vocab_size: int
    max_n: int
    max_num_seqs: int  # a request's n sequences are seated together, so n can never exceed it
    max_logprobs: int
    max_queue_len: int  # sequences that may wait beyond the running batch's seats


def check_admissible(limits: RequestLimits, num_prompts: int, n: int) -> None:
    """A request whose prompts are queued together (all or none, as a server does with a list of prompts)
    must fit what an idle engine can hold at once, or no retry would ever admit it: ValueError."""
    num_sequences = num_prompts * n
    capacity = limits.max_num_seqs + limits.max_queue_len
    if num_sequences > capacity:
        raise ValueError(
            f"the request can never be admitted: {num_prompts} prompts x n={n} make {num_sequences} sequences, "
            f"more than this server holds at once ({limits.max_num_seqs} running + {limits.max_queue_len} waiting)"
        )


def check_request(limits: RequestLimits, token_ids: list[int], params: SamplingParams) -> None:
    """Raises ValueError (or ContextLengthError) naming the offending field when the engine cannot run it."""
    check_prompt_tokens(limits, token_ids)
    params.check_token_ids(limits.vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limits.max_logprobs:
            raise ValueError(f"{name} must be <= {limits.max_logprobs}, got {value}")
    if params.n > limits.max_n:
        raise ValueError(f"n must be <= {limits.max_n}, got {params.n}")
    if params.n > limits.max_num_seqs:
        raise ValueError(f"n must be <= max_num_seqs ({limits.max_num_seqs}), got {params.n}")
    # Up to max_model_len, max_tokens is clamped to the room the prompt leaves; beyond it, it can never fit.
    if params.max_tokens is not None and params.max_tokens > limits.max_model_len:
        raise ValueError(
            f"max_tokens must be <= {limits.max_model_len} (this model's context), got {params.max_tokens}"
        )
    if len(token_ids) >= limits.max_model_len:
        raise ContextLengthError(len(token_ids), limits.max_model_len)
    room = limits.max_model_len - len(token_ids)
    if params.min_tokens > room:
        raise ValueError(
            f"min_tokens ({params.min_tokens}) does not fit: the prompt leaves room for {room} tokens "
            f"of this model's {limits.max_model_len}-token context (and KV cache)"
        )


def check_prompt_tokens(limits: RequestLimits, token_ids: list[int]) -> None:
    if not token_ids:
        raise ValueError("the prompt is empty")
    if any(not isinstance(t, int) for t in token_ids) or min(token_ids) < 0 or max(token_ids) >= limits.vocab_size:
        raise ValueError(f"prompt token ids must be integers in [0, {limits.vocab_size})")
