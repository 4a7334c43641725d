"""Sampler processors on crafted logits: each parameter changes exactly what it should."""

from __future__ import annotations

import math

import torch

from pagedserve.engine.core.sampler import Sampler, apply_logit_processors
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduling.request import Request

VOCAB = 8


def request(prompt: list[int], outputs: list[int] = (), seed: int | None = None, **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(**params), max_tokens=100, eos_token_ids=frozenset({7}), seed=seed)
    for token in outputs:
        r.append_output_token(token)
    return r


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_takes_argmax() -> None:
    out = Sampler()(logits([0, 1, 5, 2, 0, 0, 0, 0]), [request([1], temperature=0)])
    assert out.token_ids == [2]


def test_repetition_penalty_shrinks_seen_tokens_both_signs() -> None:
    r = request([1], outputs=[2], repetition_penalty=2.0)
    out = apply_logit_processors(logits([1, 4, -2, 3, 0, 0, 0, 0]), [r])
    assert out[0].tolist()[:4] == [1, 2, -4, 3]


def test_frequency_and_presence_penalties_count_outputs_only() -> None:
    r = request([3], outputs=[1, 1, 2], frequency_penalty=0.5, presence_penalty=1.0)
    out = apply_logit_processors(logits([0] * VOCAB), [r])[0].tolist()
    assert out[1] == -2.0 and out[2] == -1.5 and out[3] == 0.0


def test_logit_bias_and_min_tokens() -> None:
    r = request([1], logit_bias={4: 100.0}, min_tokens=2, stop_token_ids=[5])
    out = apply_logit_processors(logits([0, 0, 0, 0, 0, 9, 0, 9]), [r])[0]
    assert out[4] == 100 and out[5] == float("-inf") and out[7] == float("-inf")
    r.append_output_token(0)
    r.append_output_token(0)
    out = apply_logit_processors(logits([0, 0, 0, 0, 0, 9, 0, 9]), [r])[0]
    assert out[5] == 9 and out[7] == 9


def test_top_k_top_p_min_p_restrict_the_draw() -> None:
    row = [4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]
    for params, allowed in [
        (dict(top_k=2), {0, 1}),
        (dict(top_p=0.5), {0}),
        (dict(min_p=0.3), {0, 1}),
    ]:
        seen = set()
        for seed in range(200):
            seen.update(Sampler()(logits(row), [request([1], seed=seed, **params)]).token_ids)
        assert seen == allowed, params


def test_seeded_rows_ignore_batch_mates() -> None:
    row = [1.0] * VOCAB
    alone = Sampler()(logits(row), [request([1], seed=7)]).token_ids
    with_others = Sampler()(logits(row, row, row), [request([1]), request([1], seed=7), request([1])]).token_ids
    assert with_others[1] == alone[0]


def test_logprobs_are_a_distribution() -> None:
    row = [2.0, 1.0, 0.5, 0.0, 0.0, 0.0, -1.0, -5.0]
    out = Sampler()(logits(row), [request([1], temperature=0, logprobs=8)])
    entry = out.logprobs[0]
    assert entry is not None and entry.token_id == 0
    assert math.isclose(sum(math.exp(lp) for _, lp in entry.top), 1.0, rel_tol=1e-5)
    assert [t for t, _ in entry.top][:2] == [0, 1]
    assert math.isclose(entry.logprob, entry.top[0][1])


def test_allowed_token_ids_keep_only_those_tokens_in_their_row() -> None:
    restricted = request([1], allowed_token_ids=[5, 3, 3], temperature=0)
    free = request([1], temperature=0)
    rows = logits([0, 9, 0, 1, 0, 2, 0, 0], [0, 9, 0, 1, 0, 2, 0, 0])
    out = apply_logit_processors(rows, [restricted, free])
    assert out[0].tolist() == [-math.inf, -math.inf, -math.inf, 1, -math.inf, 2, -math.inf, -math.inf]
    assert out[1].tolist() == rows[1].tolist()
    assert Sampler()(rows, [restricted, free]).token_ids == [5, 1]
    drawn = {Sampler()(rows, [request([1], allowed_token_ids=[3, 5], seed=s)]).token_ids[0] for s in range(20)}
    assert drawn <= {3, 5}
