"""Gemma 2 and Gemma 3 (text), native: greedy tokens and logprobs equal to transformers' eager implementation
(float32), with prompts longer than the sliding window, chunked prefill, a prefix-cache hit and preemption; through
the engine, the offline API and the server."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import transformers

from pagedserve import LLM
from pagedserve.engine import SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.scheduling.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedserve.engine.worker.cuda_graphs import eager_capture
from pagedserve.engine.worker.kv_groups import kv_cache_groups
from pagedserve.engine.worker.model_loader import LoadedModel, load_model
from pagedserve.engine.worker.models.gemma import GemmaForCausalLM
from pagedserve.server import ServerSettings
from tests.servers import served_engine

WINDOW = 8
GEMMA_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,  # not head_dim: the scale must come from it
    max_position_embeddings=2048,
    vocab_size=49152,  # the SmolLM2 tokenizer's
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    initializer_range=0.05,  # varied tokens, which the window and the attention soft-cap both change
)
GEMMA3_TEXT: dict[str, Any] = dict(
    GEMMA_COMMON,
    # Gemma 3's pattern: five windowed layers to a global one, so five windowed KV cache groups beside the global one
    num_hidden_layers=6,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    final_logit_softcapping=3.0,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    },
)
CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "gemma2": lambda: transformers.Gemma2Config(
        **GEMMA_COMMON, attn_logit_softcapping=2.0, final_logit_softcapping=3.0
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(**GEMMA3_TEXT),
    # Gemma 3 4B and larger: image and text (served text in, text out)
    "gemma3-image-text": lambda: transformers.Gemma3Config(
        text_config=GEMMA3_TEXT,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        mm_tokens_per_image=4,
        image_token_id=49000,
        boi_token_index=49001,
        eoi_token_index=49002,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    ),
}
MAX_TOKENS = 16
BLOCK_SIZE = 4
SHARED = list(range(200, 236))  # 36 tokens two prompts share: nine full blocks to find in the prefix cache
PROMPTS = [list(range(300, 312)), SHARED + [400, 401, 402, 403], list(range(500, 545)), SHARED + [600, 601, 602]]


def save_tiny_gemma(family: str, folder: Path, tokenizer_dir: Path) -> Path:
    """A random Gemma whose norms are random too (transformers starts them at 0, i.e. a scale of 1)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(torch.randn_like(parameter))
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def gemma_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    return save_tiny_gemma(request.param, tmp_path_factory.mktemp(request.param), smol_dir)


@pytest.fixture(scope="module")
def reference(gemma_dir: Path) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and their logprobs, eager attention (the one that soft-caps)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gemma_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    outputs = []
    with torch.no_grad():
        for ids in PROMPTS:
            generated = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = generated.sequences[0, len(ids) :].tolist()
            logprobs = [step.log_softmax(-1)[0, t].item() for step, t in zip(generated.logits, tokens)]
            outputs.append((tokens, logprobs))
    assert any(len(set(tokens)) > 3 for tokens, _ in outputs), "a model that repeats one token would test little"
    return outputs


@pytest.fixture(scope="module")
def gemma_loaded(gemma_dir: Path) -> LoadedModel:
    return load_model(EngineConfig(model=str(gemma_dir)))


def mixed_config(gemma_dir: Path, **overrides: Any) -> EngineConfig:
    """Prefill chunks of 16 tokens; 12 blocks of 4 tokens a KV cache group, which the groups share, hold two or
    three requests: the others are preempted."""
    settings: dict[str, Any] = dict(
        model=str(gemma_dir),
        max_num_batched_tokens=16,
        block_size=BLOCK_SIZE,
        num_kv_blocks=12 * _num_kv_groups(gemma_dir),
        activation_dtype="float32",
    )
    return EngineConfig(**{**settings, **overrides})


def _num_kv_groups(gemma_dir: Path) -> int:
    config = json.loads((gemma_dir / "config.json").read_text())
    layer_types = config.get("text_config", config)["layer_types"]
    return kv_cache_groups([WINDOW if kind == "sliding_attention" else None for kind in layer_types]).num_groups


def test_gemma_model_is_native(gemma_loaded: LoadedModel) -> None:
    model = gemma_loaded.model
    assert isinstance(model, GemmaForCausalLM)
    windows = [layer.self_attn.sliding_window for layer in model.layers]
    config = gemma_loaded.hf_config
    layer_types = getattr(config, "text_config", config).layer_types
    assert windows == [WINDOW if kind == "sliding_attention" else None for kind in layer_types]
    assert WINDOW in windows and None in windows
    assert all(len(p) > WINDOW for p in PROMPTS)


def test_engine_matches_transformers_with_chunks_prefix_hit_and_preemption(gemma_loaded, gemma_dir, reference) -> None:
    engine = LLMEngine(mixed_config(gemma_dir), loaded=gemma_loaded)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    engine.add_request("warm", PROMPTS[1], params)  # its blocks cached before the batch asks for them
    _run(engine)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), ids, params)
    tokens, logprobs = _run(engine)
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == [t for t, _ in reference]
    for i, (_, expected) in enumerate(reference):
        torch.testing.assert_close(logprobs[str(i)], expected, atol=1e-4, rtol=1e-4)  # the final soft-cap
    assert engine.kv.prefix_hits > 0
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.num_steps > sum(map(len, PROMPTS)) // 16  # prompts were prefilled in chunks
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def _run(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        computed = {r.request_id: r.num_computed_tokens for r in engine.scheduler.running}
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            chosen = [entry.logprob for entry in delta.new_logprobs or []]
            logprobs.setdefault(delta.request_id, []).extend(chosen)
        _check_window_blocks(engine, computed)
    return tokens, logprobs


def _check_window_blocks(engine: LLMEngine, computed_before: dict[str, int]) -> None:
    """A sequence that decoded one token this step holds at most its window's blocks in each windowed group."""
    assert isinstance(engine.kv, HybridKVCacheManager)
    bound = -(-WINDOW // engine.kv.block_size) + 1
    for request in engine.scheduler.running:
        if request.num_computed_tokens == computed_before.get(request.request_id, -1) + 1:
            held = [group.num_held(request.request_id) for group in engine.kv.windowed]
            assert max(held) <= bound, (request, held)
            assert len(engine.kv.block_ids(request.request_id)) > bound  # while the global group keeps them all


def test_offline_api_matches_transformers(gemma_loaded, gemma_dir, reference) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM.from_config(mixed_config(gemma_dir, engine_process=False), gemma_loaded) as llm:
        llm.generate([PROMPTS[1]], params, use_tqdm=False)
        # The prompt that shares the warm-up's prefix first: a windowed group's blocks leave the window, and a
        # pool this small hands them out again soon after.
        order = [3, 0, 1, 2]
        outputs = dict(zip(order, llm.generate([PROMPTS[i] for i in order], params, use_tqdm=False)))
    assert [outputs[i].outputs[0].token_ids for i in range(len(PROMPTS))] == [t for t, _ in reference]
    assert outputs[3].num_cached_tokens >= 32


def test_server_matches_transformers(gemma_loaded, gemma_dir, reference) -> None:
    tokenizer = gemma_loaded.tokenizer
    with served_engine(mixed_config(gemma_dir), gemma_loaded, ServerSettings(["gemma"])) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        texts = []
        for ids in PROMPTS:
            completion = client.completions.create(model="gemma", prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
            texts.append(completion.choices[0].text)
    assert texts == [tokenizer.decode(tokens) for tokens, _ in reference]


def test_triton_backend_matches_transformers(tmp_path: Path, smol_dir: Path) -> None:
    """Gemma 2 (windows and caps) on the Triton backend, interpreted on the CPU: head_dim 64, its smallest."""
    folder = tmp_path / "gemma2-hd64"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(GEMMA_COMMON, "head_dim", 64)
        save_tiny_gemma("gemma2", folder, smol_dir)
    prompt = list(range(500, 520))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :].tolist()
    config = mixed_config(
        folder, attention_backend="triton", max_num_batched_tokens=8, block_size=8, engine_process=False
    )
    with LLM.from_config(config) as llm:
        got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected


def test_decode_graphs_read_each_groups_block_tables(tmp_path: Path, smol_dir: Path) -> None:
    """Recorded decode steps (here replayed by running them again: no GPU) hold each KV cache group's tables."""
    folder = tmp_path / "gemma2-hd64"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(GEMMA_COMMON, "head_dim", 64)
        save_tiny_gemma("gemma2", folder, smol_dir)
    prompt = list(range(500, 520))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    engine = LLMEngine(mixed_config(folder, attention_backend="triton", max_num_batched_tokens=8, block_size=8))
    engine.runner.capture_decode_graphs([1, 2], engine.max_model_len, eager_capture)
    engine.add_request("0", prompt, SamplingParams(temperature=0.0, max_tokens=12))
    tokens, _ = _run(engine)
    assert tokens["0"] == expected
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.num_replays >= 10 and graphs.buffers.block_tables.shape[0] == 2


def test_two_ranks_match_transformers(gemma_dir, reference) -> None:
    """Split over two ranks (gloo): heads, MLP width and vocabulary; Gemma's norms whole on every rank."""
    config = mixed_config(gemma_dir, tensor_parallel_size=2, num_threads=1)
    engine = LLMEngine(config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
        for i, ids in enumerate(PROMPTS):
            engine.add_request(str(i), ids, params)
        tokens, logprobs = _run(engine)
    finally:
        engine.close()
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == [t for t, _ in reference]
    for i, (_, expected) in enumerate(reference):
        torch.testing.assert_close(logprobs[str(i)], expected, atol=1e-4, rtol=1e-4)


def test_speculative_decoding_matches_transformers(gemma_loaded, gemma_dir, reference) -> None:
    """Proposed tokens verified several rows at a time, each row over its own window."""
    config = mixed_config(
        gemma_dir,
        speculative_method="ngram",
        ngram_min=1,
        num_kv_blocks=64 * _num_kv_groups(gemma_dir),
        max_num_batched_tokens=256,
    )
    engine = LLMEngine(config, loaded=gemma_loaded)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    tokens, _ = _run(engine)
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == [t for t, _ in reference]
    assert engine.collect_stats().speculation.num_draft_tokens > 0  # ngram_min 1: a repeated token is looked up
