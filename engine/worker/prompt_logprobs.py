"""Prompt logprobs: each prompt token's logprob given the tokens before it, from the prefill's own forward pass.

A step computes positions [c, c + n) of a prompt of P tokens; the hidden state at position p gives the
distribution of token p + 1. So a chunk scores tokens c + 1 .. min(c + n, P - 1) that are not scored yet (a
request recomputed after a preemption has scored some already); the last position's distribution is the first
generated token's, which the sampler handles. Requests that ask for prompt logprobs skip the prefix cache: a
cached block has no hidden states to score (KVCacheManager.get_computed_blocks). The scheduler charges each
scored row to the step's token budget (Scheduler._fit), so a long prompt's scoring spreads over steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pagedserve.engine.outputs import TokenLogprob, scored_positions
from pagedserve.engine.worker.batch import PromptRows, ScheduledSequence

# The head's product takes other paths below 16 rows (kernels/csrc/dequantized_tiles.h: TILE_TOKENS; MKL's
# small-matrix kernels for a float head), whose sums round differently from the tiled one's.
TILED_ROWS = 16


def lm_head_chunks(num_rows: int, device: torch.device) -> list[slice]:
    """The rows of logits computed at a time. On the CPU 64: a [64, vocab] block (12 MiB at 49k tokens) stays in
    cache from the head's product through the log-softmax, top-k and rank passes over it; at 256 rows (50 MiB,
    fresh pages each time) those passes cost more than the head itself, at 64 under half. A GPU keeps 256, about
    what the memory profile (profiling.py) measures for the sampler's logits. A last chunk of under TILED_ROWS
    joins the one before, so a row's logprob does not depend on where a chunk ended. Every rank of a split model
    runs the same chunks: each chunk's logits are gathered across them."""
    size = 64 if device.type == "cpu" else 256
    starts = list(range(0, num_rows, size))
    if len(starts) > 1 and num_rows - starts[-1] < TILED_ROWS:
        starts.pop()
    return [slice(start, end) for start, end in zip(starts, [*starts[1:], num_rows])]


def rows_to_score(scheduled: Sequence[ScheduledSequence], query_start_loc: torch.Tensor) -> list[PromptRows]:
    """What this step scores: a loop over requests, vectorised over their tokens."""
    wanted = []
    for index, item in enumerate(scheduled):
        request = item.request
        if request.params.prompt_logprobs is None:
            continue
        computed = request.num_computed_tokens
        positions = scored_positions(
            computed, item.num_new_tokens, len(request.prompt_logprobs), request.num_prompt_tokens
        )
        if not positions:
            continue
        offset = int(query_start_loc[index]) - computed
        rows = torch.arange(positions.start + offset, positions.stop + offset)
        targets = torch.tensor(request.prompt_token_ids[positions.start + 1 : positions.stop + 1])
        wanted.append(PromptRows(request.request_id, rows, targets, request.params.prompt_logprobs))
    return wanted


def score(
    compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, wanted: list[PromptRows]
) -> dict[str, list[TokenLogprob]]:
    """Each request's new prompt logprobs (log-softmax in float32), with their ranks and top k."""
    device = hidden.device
    rows = torch.cat([w.rows for w in wanted]).to(device)
    targets = torch.cat([w.targets for w in wanted]).to(device)
    max_k = max(w.top_k for w in wanted)
    chosen, ranks, top_values, top_ids = [], [], [], []
    for part in lm_head_chunks(len(rows), device):
        logits = compute_logits(hidden[rows[part]]).float()
        logprobs = torch.log_softmax(logits, dim=-1, out=_in_place(logits))
        picked = logprobs.gather(1, targets[part, None])
        values, ids = logprobs.topk(max(max_k, 1), dim=-1)  # one at least: the ranks start from it
        chosen.append(picked.squeeze(1))
        ranks.append(_ranks(logprobs, picked, values))
        top_values.append(values[:, :max_k])
        top_ids.append(ids[:, :max_k])
    return _per_request(
        wanted,
        targets.tolist(),
        torch.cat(chosen).tolist(),
        torch.cat(ranks).tolist(),
        torch.cat(top_values).tolist() if max_k else None,
        torch.cat(top_ids).tolist() if max_k else None,
    )


def _in_place(logits: torch.Tensor) -> torch.Tensor | None:
    """Where the log-softmax may overwrite the chunk's logits (its own tensor): on the CPU a second
    [rows, vocab] block would push the first out of the cache. Elsewhere it writes a new tensor, as before: the
    in-place form is measured and checked on the CPU only."""
    return logits if logits.device.type == "cpu" and logits.is_contiguous() else None


def _ranks(logprobs: torch.Tensor, picked: torch.Tensor, top_values: torch.Tensor) -> torch.Tensor:
    """1 + how many tokens have a higher logprob than the target ([m, vocab], [m, 1], the top k [m, k]).

    Where the target is at least the k-th best, every token above it is in the top k, so counting there is
    exact; only the other rows are compared over the whole vocabulary (a pass that costs about what the
    log-softmax does).
    """
    ranks = (top_values > picked).sum(dim=-1) + 1
    outside = (picked[:, 0] < top_values[:, -1]).nonzero().squeeze(1)
    if len(outside):
        ranks[outside] = (logprobs[outside] > picked[outside]).sum(dim=-1) + 1
    return ranks


def _per_request(
    wanted: list[PromptRows],
    targets: list[int],
    chosen: list[float],
    ranks: list[int],
    top_values: list[list[float]] | None,
    top_ids: list[list[int]] | None,
) -> dict[str, list[TokenLogprob]]:
    result: dict[str, list[TokenLogprob]] = {}
    start = 0
    for item in wanted:
        end = start + len(item.rows)
        k = item.top_k
        if top_ids is None or top_values is None or k == 0:
            tops: list[list[tuple[int, float]]] = [[] for _ in range(start, end)]
        else:
            tops = [list(zip(ids[:k], values[:k])) for ids, values in zip(top_ids[start:end], top_values[start:end])]
        result[item.request_id] = [
            TokenLogprob(token, logprob, top, rank)
            for token, logprob, top, rank in zip(targets[start:end], chosen[start:end], tops, ranks[start:end])
        ]
        start = end
    return result
