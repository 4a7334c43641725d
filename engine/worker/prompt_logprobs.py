"""Prompt logprobs: each prompt token's logprob given the tokens before it, from the prefill's own forward pass.

A step computes positions [c, c + n) of a prompt of P tokens; the hidden state at position p gives the
distribution of token p + 1. So a chunk scores tokens c + 1 .. min(c + n, P - 1) that are not scored yet (a
request recomputed after a preemption has scored some already); the last position's distribution is the first
generated token's, which the sampler handles. Requests that ask for prompt logprobs skip the prefix cache: a
cached block has no hidden states to score (KVCacheManager.get_computed_blocks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedserve.engine.outputs import TokenLogprob
from pagedserve.engine.worker.batch import PromptRows, ScheduledSequence

LM_HEAD_ROWS = 256  # logits rows at a time: a 2048-token chunk at once would take 2048 x vocab floats


def rows_to_score(scheduled: list[ScheduledSequence], query_start_loc: torch.Tensor) -> list[PromptRows]:
    """What this step scores: a loop over requests, vectorised over their tokens."""
    wanted = []
    for index, item in enumerate(scheduled):
        request = item.request
        if request.params.prompt_logprobs is None:
            continue
        computed = request.num_computed_tokens
        first = max(computed, len(request.prompt_logprobs))  # the position predicting the next unscored token
        end = min(computed + item.num_new_tokens, request.num_prompt_tokens - 1)
        if first >= end:
            continue
        offset = int(query_start_loc[index]) - computed
        rows = torch.arange(first + offset, end + offset)
        targets = torch.tensor(request.prompt_token_ids[first + 1 : end + 1])
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
    for start in range(0, len(rows), LM_HEAD_ROWS):
        part = slice(start, start + LM_HEAD_ROWS)
        logprobs = torch.log_softmax(compute_logits(hidden[rows[part]]).float(), dim=-1)
        picked = logprobs.gather(1, targets[part, None])
        chosen.append(picked.squeeze(1))
        ranks.append((logprobs > picked).sum(dim=-1) + 1)
        if max_k:
            values, ids = logprobs.topk(max_k, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
    return _per_request(
        wanted,
        targets.tolist(),
        torch.cat(chosen).tolist(),
        torch.cat(ranks).tolist(),
        torch.cat(top_values).tolist() if max_k else None,
        torch.cat(top_ids).tolist() if max_k else None,
    )


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
        items = []
        for row in range(start, start + len(item.rows)):
            top = list(zip(top_ids[row][: item.top_k], top_values[row][: item.top_k])) if top_ids and top_values else []
            items.append(TokenLogprob(targets[row], chosen[row], top, ranks[row]))
        result[item.request_id] = items
        start += len(item.rows)
    return result
