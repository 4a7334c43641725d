"""KV cache sizing: how many blocks the cache gets, how many bytes each takes, and the longest request it holds.

Every number about the cache's size is decided here, once, by `plan_kv_cache`; the engine, the block manager
and the runner only read the plan.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

import pagedserve.engine.worker.profiling as profiling
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.distributed.commands import Command, send_command
from pagedserve.engine.worker.kv_caches import kv_cache_shape
from pagedserve.engine.worker.kv_groups import KVCacheGroups, model_kv_groups, window_blocks
from pagedserve.engine.worker.loaded_model import LoadedModel
from pagedserve.engine.worker.models import ModelSpec

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: ~23k tokens of the embedded model in float32
MAX_DEFAULT_MODEL_LEN = 8192


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int  # tokens per block
    bytes_per_block: int  # K and V of every layer (of every slot, with several KV cache groups)
    max_model_len: int  # prompt plus output tokens of one request
    group_windows: tuple[int | None, ...] = (None,)  # per KV cache group: its sliding window, None for global

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def plan_kv_cache(config: EngineConfig, loaded: LoadedModel) -> KVCachePlan:
    """The configured number of blocks, or as many as the memory budget holds (profiled first on CUDA). Split
    over ranks, each rank's cache holds its own KV heads in as many blocks as rank 0's (one block table)."""
    rank_spec = loaded.spec.for_rank(config.tensor_parallel_size)
    groups = model_kv_groups(getattr(loaded, "model", None))
    bytes_per_block = kv_bytes_per_block(rank_spec, config.block_size, loaded.dtype, groups)
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        # An explicit kv_cache_memory is the budget as it is: no profiling pass to subtract from it.
        peak = None if config.kv_cache_memory is not None else _profile_peak_memory(config, loaded)
        budget = kv_cache_budget(config, loaded.device, peak)
        num_blocks = blocks_in_budget(budget, bytes_per_block)
    # A request must always fit the cache alone, or preemption could cycle forever.
    longest = longest_request(num_blocks, config.block_size, groups, config.max_num_batched_tokens)
    max_model_len = min(resolve_max_model_len(config, loaded.spec), longest)
    windows = (None,) if groups is None else groups.windows
    return KVCachePlan(num_blocks, config.block_size, bytes_per_block, max_model_len, windows)


def kv_bytes_per_block(
    spec: ModelSpec, block_size: int, dtype: torch.dtype, groups: KVCacheGroups | None = None
) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    num_tensors = spec.num_layers if groups is None else groups.num_slots
    return 2 * num_tensors * math.prod(kv_cache_shape(spec, 1, block_size)) * element


def longest_request(num_blocks: int, block_size: int, groups: KVCacheGroups | None, max_chunk: int) -> int:
    """The most tokens one request may hold in `num_blocks` blocks: each global group holds all its blocks, a
    windowed group at most its window's and a prefill chunk's (kv_groups.window_blocks)."""
    if groups is None:
        return num_blocks * block_size

    def blocks_held(num_tokens: int) -> int:
        blocks = -(-num_tokens // block_size)
        return sum(
            blocks if window is None else min(blocks, window_blocks(window, max_chunk, block_size))
            for window in groups.windows
        )

    low, high = 0, num_blocks * block_size  # blocks_held grows with the tokens: the largest that fits
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if blocks_held(middle) <= num_blocks else (low, middle - 1)
    return low


def kv_cache_budget(config: EngineConfig, device: torch.device, profile_peak_bytes: int | None) -> int:
    """Bytes for the KV cache: explicit, or what the GPU has left after a profiling pass, or a CPU default."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return max(0, int(total * config.gpu_memory_utilization) - (profile_peak_bytes or 0))
    return DEFAULT_CPU_KV_CACHE_BYTES


def blocks_in_budget(budget: int, bytes_per_block: int) -> int:
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"the KV cache budget ({budget} bytes) holds no block of {bytes_per_block} bytes")
    return num_blocks


def model_len_limit(spec: ModelSpec) -> int:
    return spec.max_position_embeddings


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    """The model's own limit (capped by default), before the cache size caps it further."""
    limit = model_len_limit(spec)
    if config.max_model_len is None:
        return min(limit, MAX_DEFAULT_MODEL_LEN)
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit of {limit} tokens")
    return config.max_model_len


def _profile_peak_memory(config: EngineConfig, loaded: LoadedModel) -> int | None:
    """Peak CUDA memory of a forward pass over a full token budget; None off CUDA, where nothing is measured."""
    if loaded.device.type != "cuda":
        return None
    if config.tensor_parallel_size == 1:
        return profiling.profile_forward_peak(loaded, config)
    assert loaded.group is not None, "a split model is loaded with its group"
    send_command(loaded.group, Command.PROFILE)  # every rank runs the pass: its collectives need them all
    return profiling.profile_forward_peak(rank_view(loaded), config)


def rank_view(loaded: LoadedModel) -> LoadedModel:
    """`loaded` as code that sizes caches from `spec` should see it: with this rank's heads."""
    return dataclasses.replace(loaded, spec=loaded.rank_spec)
