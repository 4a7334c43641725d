"""Engine logprobs in OpenAI's two formats: chat's `content` list and completions' parallel lists."""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.engine import TokenLogprob
from pagedserve.engine.outputs import PromptLogprobs
from pagedserve.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprobsOut,
    PromptTokenLogprob,
    TopLogprob,
)

# JSON has no -inf; OpenAI clients expect a finite number for impossible tokens.
MIN_LOGPROB = -9999.0

TokenText = Callable[[int], str]  # a token id's text: PromptTokenizer.token_text


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _top(token_text: TokenText, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(token_id)
    return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode()))


def chat_logprobs(items: list[TokenLogprob], token_text: TokenText) -> ChatLogprobs:
    content = [
        ChatTokenLogprob(
            **_top(token_text, item.token_id, item.logprob).model_dump(),
            top_logprobs=[_top(token_text, token_id, logprob) for token_id, logprob in item.top],
        )
        for item in items
    ]
    return ChatLogprobs(content=content)


def completion_logprobs(items: list[TokenLogprob], token_text: TokenText, first_offset: int) -> CompletionLogprobs:
    """`first_offset`: where the first of these tokens starts in the choice's text."""
    tokens = [token_text(item.token_id) for item in items]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[_finite(item.logprob) for item in items],
        top_logprobs=[_top_dict(token_text, item) for item in items],
        text_offset=_offsets(tokens, first_offset),
    )


def echoed_prompt_logprobs(
    prompt_token_ids: list[int], items: PromptLogprobs, token_text: TokenText
) -> CompletionLogprobs:
    """An echoed prompt's part of a choice's logprobs; its first token has none (null), as OpenAI did."""
    tokens = [token_text(token_id) for token_id in prompt_token_ids]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if item is None else _finite(item.logprob) for item in items],
        top_logprobs=[None if item is None else _top_dict(token_text, item) for item in items],
        text_offset=_offsets(tokens, 0),
    )


def _top_dict(token_text: TokenText, item: TokenLogprob) -> dict[str, float]:
    """The top k and the token itself, as OpenAI's completions give them ("the API will always return the logprob
    of the sampled token, so there may be up to logprobs+1 elements"): with logprobs 0, the token alone."""
    top = {token_text(token_id): _finite(logprob) for token_id, logprob in item.top}
    top.setdefault(token_text(item.token_id), _finite(item.logprob))
    return top


def _offsets(tokens: list[str], start: int) -> list[int]:
    offsets = []
    for token in tokens:
        offsets.append(start)
        start += len(token)
    return offsets


def vllm_prompt_logprobs(items: PromptLogprobs, token_text: TokenText) -> PromptLogprobsOut:
    """vLLM's `prompt_logprobs`: per prompt token, the token and the top k by id, with rank and text."""

    def entries(item: TokenLogprob) -> dict[str, PromptTokenLogprob]:
        top = ((token_id, logprob, rank) for rank, (token_id, logprob) in enumerate(item.top, start=1))
        return {
            str(token_id): {"logprob": _finite(logprob), "rank": rank, "decoded_token": token_text(token_id)}
            for token_id, logprob, rank in [(item.token_id, item.logprob, item.rank), *top]
        }

    return [None if item is None else entries(item) for item in items]
