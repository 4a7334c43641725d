"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

On tasks grounded in the prompt (summaries, rewrites, extraction, code edits) the output often copies runs of
the prompt, and once its last few tokens match a place in the prompt, what came next there is a good guess of
what comes next here: vLLM's `ngram` method, llama.cpp's lookup decoding. n goes from `max_n` down to `min_n`;
the first n that matches anywhere wins, at its latest occurrence. One vectorised comparison a sequence and n:
O(length x n) array work, no Python loop over the tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedserve.engine.speculative.proposer import ProposalContext


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_tokens: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.num_tokens = num_tokens  # k: the most tokens proposed at once

    def propose(self, sequences: Sequence[ProposalContext], max_tokens: Sequence[int]) -> list[list[int]]:
        return [
            propose_ngram(s.all_token_ids, self.min_n, self.max_n, min(self.num_tokens, limit)) if limit > 0 else []
            for s, limit in zip(sequences, max_tokens)
        ]

    def release(self, request_ids: Iterable[str]) -> None:
        """Nothing is kept between rounds: each proposal reads the sequence afresh."""


def propose_ngram(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the last n tokens (n from max_n down)."""
    length = len(token_ids)
    if k <= 0 or length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that start before the suffix itself and are followed by at least one token.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
