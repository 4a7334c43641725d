"""Prefix caching, parallel samples sharing their prompt, copy-on-write, and resumption after preemption."""

from __future__ import annotations

import pytest

import pagedserve.engine.scheduling.kv_cache_manager as kv_module
from pagedserve.engine import SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.validation import check_request
from pagedserve.engine.worker.model_loader import LoadedModel
from tests.test_block_pool import assert_pool_consistent
from tests.test_engine import prompt, run

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def make_engine(loaded: LoadedModel, **overrides) -> LLMEngine:
    settings = {"max_model_len": 2048, "num_kv_blocks": 256, **overrides}
    config = EngineConfig(model=str(loaded.model_dir), **settings)
    return LLMEngine(config, loaded=loaded)


def test_shared_prefix_is_computed_once(tiny_llama_loaded: LoadedModel) -> None:
    engine = make_engine(tiny_llama_loaded)
    system = prompt(1000, start=300)
    run(engine, {"first": (system + [7, 8, 9], GREEDY)})
    processed = engine.runner.num_tokens_processed
    out = run(engine, {"second": (system + [11, 12, 13, 14], GREEDY)})
    suffix_tokens = engine.runner.num_tokens_processed - processed
    # 1000 shared tokens are 62 full blocks (992 tokens); the rest is the suffix plus the generated tokens.
    assert suffix_tokens == (1004 - 992) + 7
    cold = run(make_engine(tiny_llama_loaded, enable_prefix_caching=False), {"x": (system + [11, 12, 13, 14], GREEDY)})
    assert out["second/0"]["tokens"] == cold["x/0"]["tokens"]
    assert engine.kv.prefix_hits == 992


def test_greedy_identical_with_and_without_cache(tiny_llama_loaded: LoadedModel) -> None:
    requests = {f"r{i}": (prompt(40, start=100) + prompt(5 + 7 * i, start=900 + i), GREEDY) for i in range(6)}
    cached_engine = make_engine(tiny_llama_loaded)
    run(cached_engine, {"warm": (prompt(40, start=100), GREEDY)})
    cached = run(cached_engine, requests)
    uncached = run(make_engine(tiny_llama_loaded, enable_prefix_caching=False), requests)
    assert cached == uncached
    assert cached_engine.kv.prefix_hits > 0


def test_forced_hash_collisions_do_not_change_outputs(
    tiny_llama_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = {f"r{i}": (prompt(50, start=100 + 13 * i), GREEDY) for i in range(4)}
    expected = run(make_engine(tiny_llama_loaded, enable_prefix_caching=False), requests)
    monkeypatch.setattr(kv_module, "hash_block", lambda parent, tokens, extra: b"collide")
    engine = make_engine(tiny_llama_loaded)
    for request_id, value in requests.items():  # one after another, so every lookup meets a cached block
        assert run(engine, {request_id: value}) == {f"{request_id}/0": expected[f"{request_id}/0"]}


def test_parallel_samples_share_prompt_blocks_and_copy_on_write(tiny_llama_loaded: LoadedModel) -> None:
    engine = make_engine(tiny_llama_loaded)
    params = SamplingParams(n=4, max_tokens=6, seed=3)
    engine.add_request("n", prompt(37), params)  # 2 full blocks + 5 tokens in a shared partial block
    engine.step()  # prefill of the prompt, once, then four first tokens
    assert engine.runner.num_tokens_processed == 37
    tables = [engine.kv.block_ids(f"n#{i}") for i in range(4)]
    assert all(t == tables[0] for t in tables)  # one copy of the prompt, shared by reference
    engine.step()  # each sample writes into the shared partial block: copy-on-write
    tables = [engine.kv.block_ids(f"n#{i}") for i in range(4)]
    assert len({t[0] for t in tables}) == 1 and len({t[1] for t in tables}) == 1
    assert len({t[2] for t in tables}) == 4
    assert engine.runner.num_tokens_processed == 37 + 4  # decodes only: the prompt was never recomputed
    run(engine, {})
    assert_pool_consistent(engine.kv.pool)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_stored_tokens_count_shared_blocks_once(tiny_llama_loaded: LoadedModel) -> None:
    engine = make_engine(tiny_llama_loaded)
    engine.add_request("n", prompt(37), SamplingParams(n=4, max_tokens=6, seed=3))
    engine.step()
    engine.step()  # four samples: two shared full blocks, four private copies of the partial block
    samples = engine.scheduler.running
    assert engine.kv.num_stored_tokens(samples) == 32 + 4 * (5 + 1)  # the first sampled token is in KV
    run(engine, {})
    assert engine.stats.peak_kv_tokens <= engine.stats.peak_kv_slots


def test_parallel_samples_equal_seeded_single_requests(tiny_llama_loaded: LoadedModel) -> None:
    together = run(make_engine(tiny_llama_loaded), {"n": (prompt(37), SamplingParams(n=4, max_tokens=6, seed=3))})
    singles = run(
        make_engine(tiny_llama_loaded),
        {f"s{i}": (prompt(37), SamplingParams(max_tokens=6, seed=3 + i)) for i in range(4)},
    )
    assert [together[f"n/{i}"]["tokens"] for i in range(4)] == [singles[f"s{i}/0"]["tokens"] for i in range(4)]


def test_preempted_requests_resume_from_the_cache(tiny_llama_loaded: LoadedModel) -> None:
    engine = make_engine(tiny_llama_loaded, num_kv_blocks=24)
    requests = {
        f"r{i}": (prompt(60, start=100 + 70 * i), SamplingParams(max_tokens=40, temperature=0)) for i in range(6)
    }
    out = run(engine, requests)
    expected = run(make_engine(tiny_llama_loaded, enable_prefix_caching=False), requests)
    assert out == expected
    assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0


def test_mixed_workload_with_aborts_leaves_only_unreferenced_cache(tiny_llama_loaded: LoadedModel) -> None:
    engine = make_engine(tiny_llama_loaded, num_kv_blocks=40)
    shared = prompt(48)
    for i in range(10):
        n = 3 if i % 3 == 0 else 1
        engine.add_request(f"r{i}", shared + prompt(3 * i, start=2000), SamplingParams(n=n, max_tokens=20, seed=i))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps in (2, 5):
            engine.abort_request(f"r{steps}")
            engine.abort_request("r0" if steps == 2 else "r9")
        assert_pool_consistent(engine.kv.pool)
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    assert not engine.scheduler.forks and engine.num_unfinished_requests == 0


def test_request_that_can_never_fit_is_rejected(tiny_llama_loaded: LoadedModel) -> None:
    engine = make_engine(tiny_llama_loaded, num_kv_blocks=4)  # 64 tokens in all
    with pytest.raises(ValueError, match="min_tokens"):
        check_request(engine.limits, prompt(40), SamplingParams(min_tokens=30, max_tokens=40))
    with pytest.raises(ValueError, match="context"):
        check_request(engine.limits, prompt(64), SamplingParams())
