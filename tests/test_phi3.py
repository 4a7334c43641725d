"""Phi-3 / Phi-4-mini (Phi3ForCausalLM) natively: greedy tokens equal transformers' generate (float32).

Tiny random models: one with LongRoPE whose prompts run past original_max_position_embeddings (a long prompt
rotates every token with the long factors, a short one switches to them as decoding passes the threshold),
one shaped like Phi-4-mini (partial rotary dimensions, tied embeddings). Through the engine with chunked
prefill, preemption and prefix-cache hits, the offline API, and a server with the openai SDK.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.scheduling.kv_cache_manager import KVCacheManager
from pagedserve.engine.scheduling.request import Request
from pagedserve.engine.scheduling.scheduler import Scheduler
from pagedserve.engine.worker.kv_sizing import model_len_limit
from pagedserve.engine.worker.model_loader import load_model
from pagedserve.engine.worker.models import ModelSpec
from pagedserve.engine.worker.models.partial_rope import PartialRotaryEmbedding
from pagedserve.server.context import ServerSettings
from tests.servers import served_engine
from tests.test_cpu_decoder import both_ways
from tests.test_tensor_parallel import TIGHT, assert_same, engine_for, run_alone, workload

SWITCH = 48  # original_max_position_embeddings
MAX_TOKENS = 12
MODEL = "phi"


def _longrope(pairs: int) -> dict[str, object]:
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
        "long_factor": [1.5 + 0.9 * i for i in range(pairs)],
        "original_max_position_embeddings": SWITCH,
    }


def _config(hidden_size: int = 64, **extra: object) -> transformers.Phi3Config:
    return transformers.Phi3Config(
        vocab_size=49152,  # the SmolLM2 tokenizer's
        hidden_size=hidden_size,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        original_max_position_embeddings=SWITCH,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.3,  # sharp attention: greedy tokens then depend on the rotation
        **extra,
    )


CONFIGS: dict[str, Callable[[], transformers.Phi3Config]] = {
    "phi3": lambda: _config(),
    "phi3-longrope": lambda: _config(rope_scaling=_longrope(8)),
    # Phi-4-mini's shape: 12 of 16 head dimensions rotated, tied embeddings
    "phi4-mini": lambda: _config(rope_scaling=_longrope(6), partial_rotary_factor=0.75, tie_word_embeddings=True),
    # head_dim 64, the smallest the Triton backend takes
    "phi4-mini-hd64": lambda: _config(
        hidden_size=256, rope_scaling=_longrope(24), partial_rotary_factor=0.75, tie_word_embeddings=True
    ),
}


@pytest.fixture(scope="module")
def phi_dir(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Callable[[str], Path]:
    made: dict[str, Path] = {}
    tokenizer = transformers.AutoTokenizer.from_pretrained(smol_dir)

    def make(name: str) -> Path:
        if name not in made:
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            made[name] = folder
        return made[name]

    return make


def prompts() -> list[list[int]]:
    """Short, crossing the switch while decoding, long; and prefixes shared between long and short prompts."""
    ids = torch.randint(3, 49152, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    return [ids[60:70], ids[:40], ids[:70], ids[:30], ids[:75], ids[5:80]]


def reference(folder: Path, token_lists: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for ids in token_lists:
            generated = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, attention_mask=torch.ones(1, len(ids))
            )
            outputs.append(generated[0, len(ids) :].tolist())
    return outputs


def run_engine(engine: LLMEngine, token_lists: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for i, ids in enumerate(token_lists):
        engine.add_request(str(i), ids, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(token_lists))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
    return [tokens[str(i)] for i in range(len(token_lists))]


@pytest.mark.parametrize("name", ["phi3", "phi3-longrope", "phi4-mini"])
def test_engine_greedy_equals_transformers_chunked_preempted_and_cached(phi_dir, name: str) -> None:
    folder = phi_dir(name)
    loaded = load_model(EngineConfig(model=str(folder)))
    assert loaded.spec.architecture == "Phi3ForCausalLM"
    assert isinstance(loaded.model.rotary, PartialRotaryEmbedding) == (name != "phi3")
    # 32-token steps chunk every long prompt; 10 blocks of 16 tokens hold about two requests at a time.
    config = EngineConfig(model=str(folder), num_kv_blocks=10, max_num_batched_tokens=32, activation_dtype="float32")
    engine = LLMEngine(config, loaded=loaded)
    expected = reference(folder, prompts())
    assert run_engine(engine, prompts()) == expected
    assert engine.scheduler.num_preemptions > 0
    assert run_engine(engine, prompts()) == expected  # again, from the prefix cache
    assert engine.kv.prefix_hits > 0
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_long_and_short_prompts_do_not_share_cached_blocks(phi_dir) -> None:
    folder = phi_dir("phi3-longrope")
    loaded = load_model(EngineConfig(model=str(folder)))
    engine = LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=64), loaded=loaded)
    ids = prompts()[4]
    long_first = [ids, ids[:33]]  # the long prompt's first two blocks were rotated with the long factors
    assert run_engine(engine, long_first[:1]) == reference(folder, long_first[:1])
    assert run_engine(engine, long_first[1:]) == reference(folder, long_first[1:])


def test_offline_api_and_server_equal_transformers(phi_dir) -> None:
    folder = phi_dir("phi4-mini")
    token_lists = prompts()[:3]
    expected = reference(folder, token_lists)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(model=str(folder), num_kv_blocks=64, engine_process=False) as llm:
        outputs = llm.generate(token_lists, params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    loaded = load_model(EngineConfig(model=str(folder)))
    with served_engine(EngineConfig(model=str(folder), num_kv_blocks=64), loaded, ServerSettings([MODEL])) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        for ids, tokens in zip(token_lists, expected):
            reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
            assert reply.choices[0].text == loaded.tokenizer.decode(tokens)


def test_native_cpu_decoder_runs_phi4_mini_as_the_modules_do(phi_dir) -> None:
    """The native decoder reads the permuted heads and the tables as Llama's: it applies, and agrees."""
    folder = phi_dir("phi4-mini")
    config = EngineConfig(model=str(folder), quantization="q8_0", num_kv_blocks=64, activation_dtype="float32")
    engine = LLMEngine(config, loaded=load_model(config))
    with_native, with_modules = both_ways(engine, prompts()[:3])
    assert {i: tokens for i, (tokens, _) in with_native.items()} == {i: t for i, (t, _) in with_modules.items()}


@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_split_over_ranks_equals_one_rank(phi_dir, size: int) -> None:
    """The fused tensors cut per rank: each rank keeps its heads' rows of q, k and v and its share of gate/up."""
    folder = phi_dir("phi4-mini")
    expected = run_alone(engine_for(folder, 1, **TIGHT), workload)
    assert_same(expected, run_alone(engine_for(folder, size, **TIGHT), workload))


def test_a_sequence_crossing_the_threshold_is_recomputed_long_and_proposals_stop_short_of_it() -> None:
    kv = KVCacheManager(16, 16, long_rope_threshold=SWITCH)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, max_queue_len=8)
    request = Request("r", list(range(SWITCH - 1)), SamplingParams(max_tokens=8), max_tokens=8)
    scheduler.add_request(request)
    scheduler.update(scheduler.schedule(), {"r": 5})  # SWITCH tokens, the last not computed
    step = scheduler.schedule({"r": [6]})
    assert [s.draft_token_ids for s in step.scheduled] == [[]]  # verified, it would hold SWITCH + 1 tokens
    assert not request.long_rope
    scheduler.update(step, {"r": 6})  # SWITCH + 1 tokens: past the threshold
    step = scheduler.schedule()
    assert request.long_rope and [(s.request, s.num_new_tokens) for s in step.scheduled] == [(request, SWITCH + 1)]


def test_a_sliding_window_is_attended_as_for_mistral() -> None:
    """Phi-3-mini-4k's sliding_window (2047 of 4096): every layer reads its window; the context is not capped."""
    config = _config(sliding_window=100)
    assert ModelSpec.from_hf_config(config).sliding_window == 100
    assert model_len_limit(ModelSpec.from_hf_config(config)) == 512


def test_triton_backend_equals_transformers(phi_dir) -> None:
    """Interpreted on the CPU here (tests/conftest.py), compiled on CUDA: the permuted heads and both tables."""
    pytest.importorskip("triton")
    folder = phi_dir("phi4-mini-hd64")
    token_lists = prompts()[:3]
    config = dict(attention_backend="triton", num_kv_blocks=16, max_num_batched_tokens=32, engine_process=False)
    with LLM(model=str(folder), **config) as llm:
        outputs = llm.generate(token_lists, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference(folder, token_lists)
