"""KV cache sizing (kv_sizing) and the request groups of parallel sampling (parallel_sampling), on plain
numbers: a config, a hand-written ModelSpec and fake requests, no model load."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import pagedserve.engine.profiling as profiling
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.kv_sizing import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    MAX_DEFAULT_MODEL_LEN,
    KVCachePlan,
    kv_bytes_per_block,
    kv_cache_budget,
    plan_kv_cache,
    resolve_max_model_len,
)
from pagedserve.engine.model_runner import allocate_kv_caches
from pagedserve.engine.models import ModelSpec
from pagedserve.engine.parallel_sampling import (
    PendingForks,
    RequestGroups,
    expand_logits,
    make_samples,
    sibling_rows,
)
from pagedserve.engine.request import Request
from pagedserve.engine.sampling_params import SamplingParams

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


# ---- kv_sizing -----------------------------------------------------------------------------------------


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
    windowed = dataclasses.replace(SPEC, sliding_window=1024)
    assert resolve_max_model_len(EngineConfig(), windowed) == 1024
    assert resolve_max_model_len(EngineConfig(max_model_len=300), SPEC) == 300
    with pytest.raises(ValueError, match="exceeds the model's limit of 1024"):
        resolve_max_model_len(EngineConfig(max_model_len=2000), windowed)


def test_max_model_len_never_exceeds_the_cache() -> None:
    plan = plan_kv_cache(EngineConfig(num_kv_blocks=4, max_model_len=2048), fake_loaded())
    assert plan.max_model_len == plan.num_tokens == 64


def test_the_plan_is_frozen() -> None:
    plan = plan_kv_cache(EngineConfig(num_kv_blocks=2), fake_loaded())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_blocks = 3  # type: ignore[misc]


# ---- parallel_sampling ---------------------------------------------------------------------------------


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
