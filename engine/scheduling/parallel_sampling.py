"""Parallel sampling (n > 1): one prompt's n sequences, from their ids and seeds to the logits they share.

The first sequence (the leader) computes the prompt alone. Its siblings wait until the leader samples its
first token; then they draw their own first tokens from the leader's logits row and fork from its blocks
(the block manager shares them and copies on write). Each sequence reports under the caller's id with its
index, so callers never see the per-sequence ids.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduling.request import Request


def sample_id(request_id: str, index: int, n: int) -> str:
    """The id of sequence `index`: the caller's own when n == 1, so single requests keep their id."""
    return request_id if n == 1 else f"{request_id}#{index}"


def sample_seed(seed: int | None, index: int) -> int | None:
    """seed + index: sample i of a request draws what a single request seeded seed + i would."""
    return None if seed is None else seed + index


def make_samples(
    request_id: str,
    token_ids: list[int],
    params: SamplingParams,
    *,
    max_tokens: int,
    eos_token_ids: frozenset[int],
    arrival_time: float | None,
) -> list[Request]:
    """The n sequences of one prompt, leader first."""
    return [
        Request(
            sample_id(request_id, i, params.n),
            token_ids,
            params,
            max_tokens=max_tokens,
            eos_token_ids=eos_token_ids,
            seed=sample_seed(params.seed, i),
            arrival_time=arrival_time,
            parent_id=request_id,
            index=i,
        )
        for i in range(params.n)
    ]


class RequestGroups:
    """The caller's ids, each with the ids of its sequences not yet finished; a group ends with its last one."""

    def __init__(self) -> None:
        self._members: dict[str, list[str]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._members

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def add(self, request_id: str, samples: list[Request]) -> None:
        self._members[request_id] = [s.request_id for s in samples]

    def members(self, request_id: str) -> list[str]:
        """A copy: finishing the members changes the group while the caller walks it."""
        return list(self._members.get(request_id, ()))

    def discard(self, sample: Request) -> None:
        members = self._members.get(sample.parent_id)
        if members is None or sample.request_id not in members:
            return
        members.remove(sample.request_id)
        if not members:
            del self._members[sample.parent_id]


class PendingForks:
    """Siblings waiting, by their leader's id, for the leader's first token to fork from it."""

    def __init__(self) -> None:
        self._by_leader: dict[str, list[Request]] = {}

    def __len__(self) -> int:
        return len(self._by_leader)

    def add(self, leader: Request, siblings: list[Request]) -> None:
        if siblings:
            self._by_leader[leader.request_id] = siblings

    def seats_needed(self, request: Request) -> int:
        """Running seats `request` takes once admitted: its siblings fork into the batch with it."""
        return 1 + len(self._by_leader.get(request.request_id, ()))

    def pending(self, request: Request) -> list[Request]:
        """The siblings that fork from `request` when it samples its first token this step."""
        if request.num_output_tokens > 0:
            return []
        return self._by_leader.get(request.request_id, [])

    def pop(self, leader: Request) -> list[Request]:
        return self._by_leader.pop(leader.request_id, [])

    def forget(self, request: Request) -> Request | None:
        """Drops an ending sequence. An ending leader hands its unforked siblings to the first of them, which
        is returned: it must be queued to compute the prompt in the leader's place."""
        siblings = self._by_leader.pop(request.request_id, None)
        successor = None
        if siblings:
            successor = siblings[0]
            self.add(successor, siblings[1:])
        for leader_id, group in self._by_leader.items():
            if request in group:
                group.remove(request)
                if not group:
                    del self._by_leader[leader_id]
                break
        return successor


def sibling_rows(sampling: list[Request], forks: PendingForks) -> tuple[list[Request], list[int]]:
    """The requests to sample this step with their logits rows: one row each, and the siblings forking
    this step after them, on their leader's row (parallel samples draw from the same logits)."""
    requests = list(sampling)
    rows = list(range(len(sampling)))
    for row, request in enumerate(sampling):
        siblings = forks.pending(request)
        requests.extend(siblings)
        rows.extend([row] * len(siblings))
    return requests, rows


def expand_logits(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Logits with one row per entry of `rows`; unchanged when no sibling forks (rows is then 0..R-1)."""
    if len(rows) > logits.shape[0]:
        return logits[torch.tensor(rows, device=logits.device)]
    return logits
