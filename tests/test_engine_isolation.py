"""One request's failure inside an engine step fails that request alone: the others keep their exact tokens."""

from __future__ import annotations

import pytest

from pagedserve.engine import SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.worker.model_loader import LoadedModel
from tests.test_engine import prompt, run

INNOCENT = {
    "greedy": (prompt(7), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
    "seeded": (prompt(9, 300), SamplingParams(max_tokens=12, temperature=1.0, top_k=40, seed=11, ignore_eos=True)),
    "pair": (prompt(5, 500), SamplingParams(n=2, max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)),
    "biased": (prompt(6, 700), SamplingParams(max_tokens=12, temperature=0, logit_bias={9: 3.0}, ignore_eos=True)),
}


@pytest.fixture
def engine(tiny_llama_loaded: LoadedModel) -> LLMEngine:
    config = EngineConfig(model=str(tiny_llama_loaded.model_dir), num_kv_blocks=64, max_model_len=256)
    return LLMEngine(config, loaded=tiny_llama_loaded)


def poisoned_params(vocab_size: int) -> SamplingParams:
    """Passes SamplingParams' own checks, then names a token outside the vocabulary: what a bug or a missed
    check would let through. The sampler raises on it."""
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=3)
    params.logit_bias = {vocab_size + 10: 1.0}
    return params


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests() and engine.request_ids() == []
    assert engine.kv.pool.num_free == engine.kv.num_blocks  # cached prefix blocks count as free


def drive(engine: LLMEngine, late: dict[str, tuple[list[int], SamplingParams]], after_steps: int) -> dict[str, dict]:
    """Runs INNOCENT to the end, adding `late` after `after_steps` steps; tokens and finish by sequence."""
    for request_id, (tokens, params) in INNOCENT.items():
        engine.add_request(request_id, tokens, params)
    results: dict[str, dict] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == after_steps:
            for request_id, (tokens, params) in late.items():
                engine.add_request(request_id, tokens, params)
        for delta in engine.step():
            entry = results.setdefault(f"{delta.request_id}/{delta.index}", {"tokens": [], "finish": None})
            entry["tokens"] += delta.new_token_ids
            entry["finish"] = delta.finish_reason
        steps += 1
    return results


def test_a_request_whose_sampling_raises_fails_alone(engine: LLMEngine) -> None:
    alone = run(engine, dict(INNOCENT))
    engine.reset_prefix_cache()
    poison = {"poison": (prompt(4, 900), poisoned_params(engine.limits.vocab_size))}
    together = drive(engine, poison, after_steps=2)  # it joins a batch already generating
    assert together.pop("poison/0")["finish"] == "error"
    assert {k: v["tokens"] for k, v in together.items()} == {k: v["tokens"] for k, v in alone.items()}
    assert all(v["finish"] == "length" for v in together.values())
    assert_idle(engine)


def test_a_batch_with_a_poisoned_request_from_the_start(engine: LLMEngine) -> None:
    alone = run(engine, dict(INNOCENT))
    engine.reset_prefix_cache()
    results = run(engine, {**INNOCENT, "poison": (prompt(4, 900), poisoned_params(engine.limits.vocab_size))})
    assert results.pop("poison/0")["finish"] == "error"
    assert {k: v["tokens"] for k, v in results.items()} == {k: v["tokens"] for k, v in alone.items()}
    assert_idle(engine)


class FailingDetokenizer:
    """Stands in for one sequence's detokenizer: decodes nothing, then raises at its third token."""

    def __init__(self) -> None:
        self.calls = 0

    def update(self, token_ids: list[int]) -> tuple[str, str | None]:
        self.calls += 1
        if self.calls == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return "", None

    def flush(self) -> str:
        return ""


@pytest.mark.parametrize("fail_sibling", [False, True])
def test_a_request_whose_detokenization_raises_fails_alone(engine: LLMEngine, fail_sibling: bool) -> None:
    alone = run(engine, dict(INNOCENT))
    engine.reset_prefix_cache()
    for request_id, (tokens, params) in INNOCENT.items():
        engine.add_request(request_id, tokens, params)
    victim = "pair#1" if fail_sibling else "greedy"
    engine._detokenizers[victim] = FailingDetokenizer()  # type: ignore[assignment]
    results = run(engine, {})
    failed = "pair" if fail_sibling else "greedy"
    for key, expected in alone.items():
        if key.startswith(failed + "/"):
            assert results[key]["finish"] == "error"
        else:
            assert results[key]["tokens"] == expected["tokens"], key
    assert_idle(engine)
