"""Token masks for a step: llguidance's packed bitmasks, the bias they become, and the worker thread that fills
them while the forward runs (llguidance releases the GIL); the engine applies them before any sampling parameter.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

import llguidance
import torch


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """llguidance's mask layout: one int32 word per 32 tokens, every bit set (all allowed) until filled.

    Written here rather than taken from llguidance.torch, whose import decorates a function with torch.compile
    and so imports Triton early, before a program's TRITON_INTERPRET setting is read."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool from llguidance's [rows, ceil(vocab/32)] int32 bitmask (bit j of word i is
    token 32 i + j)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def only_allowed_token(matcher: llguidance.LLMatcher, vocab_size: int) -> int | None:
    """The one token the matcher admits next, or None when it admits several (or none). Read off the packed
    mask: one non-zero word with one bit set (unpacking the whole vocabulary would cost far more)."""
    bitmask = new_bitmask(1, vocab_size)
    matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
    words = bitmask[0].nonzero()
    if words.shape[0] != 1:
        return None
    index = int(words[0, 0])
    word = int(bitmask[0, index]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return 32 * index + word.bit_length() - 1


@dataclass
class GrammarRows:
    """The step's constrained rows of the sampling batch, and an additive bias for each: 0 for the tokens its
    constraint admits, -inf for the others ([rows, vocab] float32, built on the worker thread)."""

    rows: torch.Tensor
    bias: torch.Tensor

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` with every token the constraints refuse at -inf: one pass over the logits."""
        return logits.float().index_add(0, self.rows.to(logits.device), self.bias.to(logits.device))


class StepMasks:
    """Fills a step's masks on a worker thread: started before the forward, awaited before sampling."""

    def __init__(self, vocab_size: int, num_threads: int = 1) -> None:
        self._vocab_size = vocab_size
        self._num_threads = num_threads
        self._executor: llguidance.LLExecutor | None = None  # made at the first mask: most engines never need one
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedserve-grammar")
        self.mask_seconds = 0.0  # filling masks, on the worker thread
        self.wait_seconds = 0.0  # the step waiting for them after its forward

    def start(self, matchers: list[llguidance.LLMatcher | None]) -> concurrent.futures.Future[GrammarRows] | None:
        """Masks for the rows that have a matcher (None: nothing to mask this step)."""
        constrained = [(row, m) for row, m in enumerate(matchers) if m is not None]
        if not constrained:
            return None
        return self._pool.submit(self._fill, constrained)

    def wait(self, pending: concurrent.futures.Future[GrammarRows] | None) -> GrammarRows | None:
        if pending is None:
            return None
        start = time.perf_counter()
        try:
            return pending.result()
        finally:
            self.wait_seconds += time.perf_counter() - start

    def _fill(self, constrained: list[tuple[int, llguidance.LLMatcher]]) -> GrammarRows:
        start = time.perf_counter()
        bitmask = new_bitmask(len(constrained), self._vocab_size)
        pairs = [(matcher, i) for i, (_, matcher) in enumerate(constrained)]
        if self._executor is None:  # only ever touched on the worker thread
            self._executor = llguidance.LLExecutor(num_threads=self._num_threads)
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(constrained))
        rows = torch.tensor([row for row, _ in constrained])
        refused = ~allowed_tokens(bitmask, self._vocab_size)
        bias = torch.zeros(refused.shape).masked_fill_(refused, float("-inf"))
        result = GrammarRows(rows, bias)
        self.mask_seconds += time.perf_counter() - start
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
