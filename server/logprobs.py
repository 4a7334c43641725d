"""Engine logprobs in OpenAI's two formats: chat's `content` list and completions' parallel lists."""

from __future__ import annotations

import functools

from transformers import PreTrainedTokenizerBase

from pagedserve.engine import TokenLogprob
from pagedserve.server.responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

# JSON has no -inf; OpenAI clients expect a finite number for impossible tokens.
MIN_LOGPROB = -9999.0


def decode(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> str:
    text = tokenizer.decode(token_ids)
    assert isinstance(text, str)  # a list comes back only for batched input
    return text


class TokenTexts:
    """Token id -> its text, cached: the same few thousand tokens come back all the time."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.text = functools.lru_cache(maxsize=1 << 16)(lambda token_id: decode(tokenizer, [token_id]))


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _top(texts: TokenTexts, token_id: int, logprob: float) -> TopLogprob:
    text = texts.text(token_id)
    return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode()))


def chat_logprobs(items: list[TokenLogprob], texts: TokenTexts) -> ChatLogprobs:
    content = [
        ChatTokenLogprob(
            **_top(texts, item.token_id, item.logprob).model_dump(),
            top_logprobs=[_top(texts, token_id, logprob) for token_id, logprob in item.top],
        )
        for item in items
    ]
    return ChatLogprobs(content=content)


def completion_logprobs(
    items: list[TokenLogprob],
    texts: TokenTexts,
    first_offset: int,
) -> CompletionLogprobs:
    """`first_offset`: where the first of these tokens starts in the choice's text."""
    tokens = [texts.text(item.token_id) for item in items]
    offsets = []
    for token in tokens:
        offsets.append(first_offset)
        first_offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[_finite(item.logprob) for item in items],
        top_logprobs=[{texts.text(t): _finite(lp) for t, lp in item.top} for item in items],
        text_offset=offsets,
    )
