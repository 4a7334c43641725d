"""KV cache sizing (engine/worker/kv_sizing.py) on plain numbers: a config, a hand-written ModelSpec and a fake GPU,
no model load."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import pagedserve.engine.worker.profiling as profiling
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.kv_caches import allocate_kv_caches
from pagedserve.engine.worker.kv_sizing import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    MAX_DEFAULT_MODEL_LEN,
    KVCachePlan,
    kv_bytes_per_block,
    kv_cache_budget,
    plan_kv_cache,
    resolve_max_model_len,
)
from pagedserve.engine.worker.models import ModelSpec

SPEC = ModelSpec(
    architecture="LlamaForCausalLM",
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    max_position_embeddings=32768,
    tie_word_embeddings=False,
    qkv_bias=False,
    qk_norm=False,
    sliding_window=None,
    eos_token_ids=(2,),
)
BLOCK_BYTES = 2 * 2 * 16 * 2 * 32 * 4  # K and V, 2 layers, 16 tokens, 2 heads of 32, float32


def fake_loaded(device: str = "cpu", spec: ModelSpec = SPEC, dtype: torch.dtype = torch.float32) -> Any:
    return SimpleNamespace(spec=spec, dtype=dtype, device=torch.device(device))


def fake_gpu(monkeypatch: pytest.MonkeyPatch, total: int, peak: int) -> list[Any]:
    """A GPU of `total` bytes whose profiling pass peaks at `peak`; returns the profiler's calls."""
    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(profiling, "profile_forward_peak", lambda loaded, config: calls.append(loaded) or peak)
    return calls


def test_block_bytes_count_k_and_v_of_every_layer() -> None:
    assert kv_bytes_per_block(SPEC, 16, torch.float32) == BLOCK_BYTES
    assert kv_bytes_per_block(SPEC, 16, torch.bfloat16) == BLOCK_BYTES // 2
    assert kv_bytes_per_block(SPEC, 32, torch.float32) == 2 * BLOCK_BYTES


def test_allocated_caches_take_the_planned_bytes() -> None:
    plan = plan_kv_cache(EngineConfig(num_kv_blocks=3), fake_loaded())
    caches = allocate_kv_caches(SPEC, plan.num_blocks, plan.block_size, torch.float32, torch.device("cpu"))
    assert sum(k.nbytes + v.nbytes for k, v in caches) == plan.num_bytes == 3 * BLOCK_BYTES


def test_configured_blocks_are_taken_as_they_are_without_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_gpu(monkeypatch, total=10**9, peak=0)
    plan = plan_kv_cache(EngineConfig(num_kv_blocks=10, kv_cache_memory=1), fake_loaded("cuda"))
    assert plan == KVCachePlan(num_blocks=10, block_size=16, bytes_per_block=BLOCK_BYTES, max_model_len=160)
    assert not calls


def test_explicit_memory_is_divided_into_whole_blocks() -> None:
    plan = plan_kv_cache(EngineConfig(kv_cache_memory=5 * BLOCK_BYTES + 100), fake_loaded())
    assert plan.num_blocks == 5 and plan.num_tokens == 80


def test_cpu_gets_the_default_budget() -> None:
    plan = plan_kv_cache(EngineConfig(), fake_loaded())
    assert plan.num_blocks == DEFAULT_CPU_KV_CACHE_BYTES // BLOCK_BYTES
    assert plan.max_model_len == MAX_DEFAULT_MODEL_LEN


def test_gpu_gets_what_the_profiling_pass_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_gpu(monkeypatch, total=10_000_000, peak=1_000_000)
    loaded = fake_loaded("cuda")
    plan = plan_kv_cache(EngineConfig(gpu_memory_utilization=0.5), loaded)
    assert plan.num_blocks == (5_000_000 - 1_000_000) // BLOCK_BYTES
    assert calls == [loaded]


def test_an_explicit_budget_on_a_gpu_skips_the_profiling_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_gpu(monkeypatch, total=10_000_000, peak=1_000_000)
    plan = plan_kv_cache(EngineConfig(kv_cache_memory=10 * BLOCK_BYTES), fake_loaded("cuda"))
    assert plan.num_blocks == 10 and calls == []


def test_a_budget_without_room_for_one_block_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch, total=1_000, peak=5_000)
    assert kv_cache_budget(EngineConfig(), torch.device("cuda"), 5_000) == 0
    with pytest.raises(ValueError, match="holds no block"):
        plan_kv_cache(EngineConfig(), fake_loaded("cuda"))
    with pytest.raises(ValueError, match="holds no block"):
        plan_kv_cache(EngineConfig(kv_cache_memory=BLOCK_BYTES - 1), fake_loaded())


def test_max_model_len_defaults_to_the_model_capped() -> None:
    assert resolve_max_model_len(EngineConfig(), SPEC) == MAX_DEFAULT_MODEL_LEN
    short = dataclasses.replace(SPEC, max_position_embeddings=2048)
    assert resolve_max_model_len(EngineConfig(), short) == 2048
    windowed = dataclasses.replace(SPEC, sliding_window=1024)  # attended, not a cap on the context
    assert resolve_max_model_len(EngineConfig(), windowed) == MAX_DEFAULT_MODEL_LEN
    assert resolve_max_model_len(EngineConfig(max_model_len=300), SPEC) == 300
    with pytest.raises(ValueError, match="exceeds the model's limit of 2048"):
        resolve_max_model_len(EngineConfig(max_model_len=4000), short)


def test_max_model_len_never_exceeds_the_cache() -> None:
    plan = plan_kv_cache(EngineConfig(num_kv_blocks=4, max_model_len=2048), fake_loaded())
    assert plan.max_model_len == plan.num_tokens == 64


def test_the_plan_is_frozen() -> None:
    plan = plan_kv_cache(EngineConfig(num_kv_blocks=2), fake_loaded())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_blocks = 3  # type: ignore[misc]
