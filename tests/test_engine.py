"""LLMEngine behaviour on a tiny random Llama: stops, limits, seeds, accounting, bad input."""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM, ContextLengthError, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.validation import check_request
from pagedserve.engine.worker.model_loader import LoadedModel

EOS = 2


@pytest.fixture
def engine(tiny_llama_loaded: LoadedModel) -> LLMEngine:
    config = EngineConfig(model=str(tiny_llama_loaded.model_dir), num_kv_blocks=64, max_model_len=256)
    return LLMEngine(config, loaded=tiny_llama_loaded)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int] | str, SamplingParams]]) -> dict[str, dict]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    results: dict[str, dict] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            entry = results.setdefault(f"{delta.request_id}/{delta.index}", {"tokens": [], "text": ""})
            entry["tokens"] += delta.new_token_ids
            entry["text"] += delta.new_text
            if delta.finished:
                entry["finish"], entry["stop_reason"] = delta.finish_reason, delta.stop_reason
    return results


def prompt(length: int, start: int = 100) -> list[int]:
    return list(range(start, start + length))


def test_max_tokens_one(engine: LLMEngine) -> None:
    out = run(engine, {"a": (prompt(5), SamplingParams(max_tokens=1, temperature=0))})["a/0"]
    assert len(out["tokens"]) == 1 and out["finish"] == "length"


def test_stop_token_ids_end_the_sequence(engine: LLMEngine) -> None:
    free_run = run(engine, {"a": (prompt(5), SamplingParams(max_tokens=6, temperature=0))})["a/0"]["tokens"]
    stop_token = free_run[2]
    out = run(engine, {"b": (prompt(5), SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop_token]))})
    first = free_run.index(stop_token)
    assert out["b/0"]["tokens"] == free_run[: first + 1]
    assert out["b/0"]["finish"] == "stop" and out["b/0"]["stop_reason"] == stop_token


def test_eos_min_tokens_and_ignore_eos(engine: LLMEngine) -> None:
    force_eos = {EOS: 100.0}
    out = run(
        engine,
        {
            "eos": (prompt(5), SamplingParams(max_tokens=8, logit_bias=force_eos)),
            "min": (prompt(5), SamplingParams(max_tokens=8, logit_bias=force_eos, min_tokens=4)),
            "ignore": (prompt(5), SamplingParams(max_tokens=8, logit_bias=force_eos, ignore_eos=True)),
        },
    )
    assert out["eos/0"]["tokens"] == [EOS] and out["eos/0"]["finish"] == "stop"
    assert len(out["min/0"]["tokens"]) == 5 and out["min/0"]["tokens"][-1] == EOS
    assert EOS not in out["min/0"]["tokens"][:4]
    assert len(out["ignore/0"]["tokens"]) == 8 and out["ignore/0"]["finish"] == "length"


def test_seeded_sampling_ignores_batch_mates(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    alone = run(engine, {"x": (prompt(20), params)})["x/0"]["tokens"]
    others = {f"o{i}": (prompt(5 + 3 * i, start=500), SamplingParams(max_tokens=10, temperature=0.8)) for i in range(7)}
    crowded = run(engine, {"x": (prompt(20), params), **others})["x/0"]["tokens"]
    assert crowded == alone


def test_n_samples_follow_seed_plus_index(engine: LLMEngine) -> None:
    out = run(engine, {"n": (prompt(9), SamplingParams(n=3, max_tokens=6, seed=10))})
    singles = run(engine, {f"s{i}": (prompt(9), SamplingParams(max_tokens=6, seed=10 + i)) for i in range(3)})
    assert [out[f"n/{i}"]["tokens"] for i in range(3)] == [singles[f"s{i}/0"]["tokens"] for i in range(3)]


def test_block_accounting_with_aborts(engine: LLMEngine) -> None:
    block_size = engine.kv.block_size
    for i in range(12):
        engine.add_request(f"r{i}", prompt(3 + 11 * i), SamplingParams(max_tokens=5 + i, temperature=0.7))
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step == 3:
            engine.abort_request("r4")
            engine.abort_request("r9")
        for request in engine.scheduler.running:
            assert len(engine.kv.req_blocks[request.request_id]) <= -(-request.num_tokens // block_size)
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not engine.kv.req_blocks and engine.num_unfinished_requests == 0


@pytest.mark.parametrize(
    "make_params",
    [
        lambda: SamplingParams(temperature=-1),
        lambda: SamplingParams(top_p=0),
        lambda: SamplingParams(logprobs=21),
        lambda: SamplingParams(max_tokens=-1),
        lambda: SamplingParams(n=0),
        lambda: SamplingParams(min_tokens=5, max_tokens=2),
        lambda: SamplingParams(stop=[""]),
        lambda: SamplingParams(presence_penalty=float("nan")),
    ],
)
def test_bad_params_name_the_field(make_params) -> None:
    with pytest.raises(ValueError, match=r"must"):
        make_params()


def test_bad_requests_are_refused_once_by_check_request(engine: LLMEngine) -> None:
    limits = engine.limits
    with pytest.raises(ValueError, match="vocabulary"):
        check_request(limits, prompt(4), SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="empty"):
        check_request(limits, [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        check_request(limits, [10**7], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        check_request(limits, [-1], SamplingParams())
    with pytest.raises(ContextLengthError, match="256"):
        check_request(limits, prompt(300), SamplingParams())
    with pytest.raises(ValueError, match=r"max_tokens must be <= 256"):
        check_request(limits, prompt(4), SamplingParams(max_tokens=257))
    engine.add_request("good", prompt(4), SamplingParams(max_tokens=4, temperature=0))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", prompt(4), SamplingParams())
    out = run(engine, {})
    assert len(out["good/0"]["tokens"]) == 4
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_more_samples_than_seats_are_refused_not_left_waiting(tiny_llama_loaded: LoadedModel) -> None:
    """A prompt's n samples are seated together: n > max_num_seqs could never start, and would hold up the
    queue behind it."""
    config = EngineConfig(model=str(tiny_llama_loaded.model_dir), num_kv_blocks=64, max_num_seqs=2)
    engine = LLMEngine(config, loaded=tiny_llama_loaded)
    with pytest.raises(ValueError, match=r"n must be <= max_num_seqs \(2\), got 3"):
        check_request(engine.limits, prompt(4), SamplingParams(n=3))
    out = run(engine, {"two": (prompt(4), SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=1))})
    assert [len(out[f"two/{i}"]["tokens"]) for i in range(2)] == [3, 3]


def test_max_tokens_is_clamped_to_the_context(engine: LLMEngine) -> None:
    out = run(engine, {"a": (prompt(250), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))})
    assert len(out["a/0"]["tokens"]) == 6 and out["a/0"]["finish"] == "length"


def test_offline_llm_api(tiny_model_dir) -> None:
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=32, engine_process=False)
    outputs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=5, temperature=0))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 5]
    assert outputs[0].prompt == "Hello" and outputs[0].outputs[0].metrics is not None
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=3, temperature=0))
    assert len(chat) == 1 and len(chat[0].outputs[0].token_ids) == 3


def test_detokenize_off_returns_ids_only(engine: LLMEngine) -> None:
    out = run(engine, {"ids": (prompt(5), SamplingParams(max_tokens=4, temperature=0, detokenize=False))})["ids/0"]
    assert len(out["tokens"]) == 4 and out["text"] == ""
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_stats_count_prompt_and_generated_tokens(engine: LLMEngine) -> None:
    run(engine, {"a": (prompt(7), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))})
    run(engine, {"b": (prompt(5), SamplingParams(n=2, max_tokens=4, temperature=0, ignore_eos=True))})
    assert engine.stats.generation_tokens == 3 + 2 * 4
    assert engine.stats.prompt_tokens == 7 + 5
