"""Parallel sampling: the n sequences of one request, their ids and seeds, and siblings that share a leader's logits."""

from __future__ import annotations

import torch

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduling.parallel_sampling import (
    PendingForks,
    RequestGroups,
    expand_logits,
    make_samples,
    sibling_rows,
)
from pagedserve.engine.scheduling.request import Request


def samples(request_id: str, n: int, seed: int | None = None) -> list[Request]:
    params = SamplingParams(n=n, seed=seed)
    return make_samples(request_id, [5, 6, 7], params, max_tokens=4, eos_token_ids=frozenset({2}), arrival_time=1.0)


def test_a_single_sample_keeps_the_callers_id_and_seed() -> None:
    (only,) = samples("r", 1, seed=7)
    assert (only.request_id, only.parent_id, only.index) == ("r", "r", 0)
    assert only.generator is not None and only.generator.initial_seed() == 7


def test_n_samples_get_numbered_ids_and_consecutive_seeds() -> None:
    group = samples("r", 3, seed=10)
    assert [s.request_id for s in group] == ["r#0", "r#1", "r#2"]
    assert [s.parent_id for s in group] == ["r"] * 3 and [s.index for s in group] == [0, 1, 2]
    assert [s.generator.initial_seed() for s in group if s.generator is not None] == [10, 11, 12]
    assert all(s.max_tokens == 4 and s.times.arrival == 1.0 for s in group)
    assert all(s.generator is None for s in samples("u", 2))


def test_a_group_ends_with_its_last_sequence() -> None:
    groups = RequestGroups()
    group = samples("r", 2)
    groups.add("r", group)
    assert "r" in groups and list(groups) == ["r"] and groups.members("r") == ["r#0", "r#1"]
    groups.discard(group[1])
    groups.discard(group[1])  # twice is harmless
    assert groups.members("r") == ["r#0"]
    groups.discard(group[0])
    assert "r" not in groups and len(groups) == 0 and groups.members("r") == []


def test_siblings_wait_for_the_leaders_first_token() -> None:
    forks = PendingForks()
    leader, *siblings = samples("r", 3)
    forks.add(leader, siblings)
    assert forks.seats_needed(leader) == 3 and forks.pending(leader) == siblings
    leader.append_output_token(9)
    assert forks.pending(leader) == []
    assert forks.pop(leader) == siblings and not forks


def test_an_ending_leader_hands_the_prompt_to_its_first_sibling() -> None:
    forks = PendingForks()
    leader, first, second = samples("r", 3)
    forks.add(leader, [first, second])
    assert forks.forget(leader) is first
    assert forks.pending(first) == [second] and forks.seats_needed(leader) == 1
    assert forks.forget(second) is None  # a sibling just leaves its group
    assert not forks and forks.seats_needed(first) == 1


def test_forking_siblings_sample_from_their_leaders_row() -> None:
    forks = PendingForks()
    a_leader, *a_siblings = samples("a", 3)
    (b,) = samples("b", 1)
    forks.add(a_leader, a_siblings)
    requests, rows = sibling_rows([b, a_leader], forks)
    assert requests == [b, a_leader, *a_siblings] and rows == [0, 1, 1, 1]
    logits = torch.tensor([[0.0], [1.0]])
    assert expand_logits(logits, rows).flatten().tolist() == [0.0, 1.0, 1.0, 1.0]
    assert expand_logits(logits, [0, 1]) is logits  # nothing forks: the runner's logits as they are
