"""CUDA backend: the kernel contract in Triton (also runs on CPU tensors under TRITON_INTERPRET=1); the dense ops
are the base class's torch defaults, but for projections kept in block formats (triton_quantized_linear.py).

`prepare` keeps the step's host-side lengths; the first layer to attend turns them into an `AttentionLaunch`
(query tiles on the device, tile shape, split count) that every later layer of the step reuses. Nothing here
reads device memory back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton

from pagedserve.kernels import triton_attention, triton_quantized_linear, triton_write_kv
from pagedserve.kernels.backend import KernelBackend
from pagedserve.kernels.device_blocks import AnyQuantizedWeight, DeviceQuantizedWeight, pack_for_device
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.quantized import FORMATS, QuantizedWeight
from pagedserve.kernels.stacked_weight import ProjectionWeight
from pagedserve.kernels.triton_attention import AttentionLaunch, TileShape, choose_tile_shape

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 128


@dataclass(frozen=True)
class SplitKVPolicy:
    """When to split a sequence's keys across programs (flash-decoding)."""

    target_programs: int | None = None  # programs that fill the GPU; None: 2 per SM, no splits off CUDA
    min_tokens_per_split: int = 256  # below this a split's merge costs more than its parallelism gains
    max_splits: int = 16


@dataclass
class _TritonPlan:
    query_lens: list[int]
    max_query_len: int
    max_seq_len: int
    device: torch.device
    # by attention shape (num_heads, num_kv_heads, head_dim): one per step for a uniform model
    launches: dict[tuple[int, int, int], AttentionLaunch] = field(default_factory=dict)


class TritonBackend(KernelBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, split_policy: SplitKVPolicy | None = None) -> None:
        self.split_policy = split_policy or SplitKVPolicy()

    def check_supported(self, dtype: torch.dtype, head_dim: int, block_size: int) -> None:
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"triton attention: dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"triton attention: head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
        if not (MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE and block_size & (block_size - 1) == 0):
            raise ValueError(
                f"triton attention: block_size must be a power of two from {MIN_BLOCK_SIZE} to "
                f"{MAX_BLOCK_SIZE}, got {block_size}"
            )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        triton_write_kv.write_kv(
            _unit_stride_head_dim(key), _unit_stride_head_dim(value), k_cache, v_cache, slot_mapping
        )

    def quantized_linear(
        self, x: torch.Tensor, weight: ProjectionWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if isinstance(weight, DeviceQuantizedWeight):
            return triton_quantized_linear.quantized_linear(x, weight, bias)
        return super().quantized_linear(x, weight, bias)

    def quantized_formats(self, device: torch.device, dtype: torch.dtype) -> frozenset[str]:
        if device.type == "cuda" and dtype in SUPPORTED_DTYPES:
            return frozenset(FORMATS)
        return super().quantized_formats(device, dtype)

    def place_quantized(self, weight: QuantizedWeight, device: torch.device) -> AnyQuantizedWeight:
        """On CUDA the blocks repacked for the Triton kernel (kernels/device_blocks.py)."""
        if device.type == "cuda":
            return pack_for_device(weight, device)
        return super().place_quantized(weight, device)

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        metadata.plan = _TritonPlan(
            list(metadata.query_lens_host),
            metadata.max_query_len,
            metadata.max_seq_len,
            metadata.seq_lens.device,
        )
        return metadata

    def paged_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        launch = self.launch_for(metadata, query.shape[1], k_cache.shape[2], query.shape[2])
        return triton_attention.paged_attention(
            _unit_stride_head_dim(query),
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            scale,
            launch,
            sliding_window,
            soft_cap,
        )

    def launch_for(
        self, metadata: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> AttentionLaunch:
        """The step's launch for one attention shape, built by the first layer and reused by the rest."""
        if metadata.plan is None:
            self.prepare(metadata)
        plan: _TritonPlan = metadata.plan
        key = (num_heads, num_kv_heads, head_dim)
        if key not in plan.launches:
            shape = choose_tile_shape(num_heads // num_kv_heads, head_dim, plan.max_query_len <= 1)
            tiles = _query_tiles(plan.query_lens, shape.tile_tokens, plan.device)
            num_splits = self._num_splits(plan, shape, tiles.shape[1] * num_kv_heads)
            plan.launches[key] = AttentionLaunch(tiles, shape, num_splits)
        return plan.launches[key]

    def _num_splits(self, plan: _TritonPlan, shape: TileShape, num_programs: int) -> int:
        """Splits the KV range only while the grid is too small to fill the GPU and contexts are long.

        Only batches whose sequences each fit one query tile (decodes, short chunks) qualify, which keeps the
        fp32 partial buffers small. The count is a power of two: few kernel variants, an exact merge tile.
        """
        policy = self.split_policy
        target = policy.target_programs or 2 * _sm_count(plan.device)
        if num_programs == 0 or num_programs >= target or plan.max_query_len > shape.tile_tokens:
            return 1
        splits = min(
            policy.max_splits,
            triton.cdiv(target, num_programs),
            plan.max_seq_len // policy.min_tokens_per_split,
        )
        return 1 << (splits.bit_length() - 1) if splits > 1 else 1


def _query_tiles(query_lens: list[int], tile_tokens: int, device: torch.device) -> torch.Tensor:
    """[2, num_tiles] int32: the sequence and the first new token of each query tile."""
    seqs: list[int] = []
    starts: list[int] = []
    for seq, query_len in enumerate(query_lens):
        tile_starts = range(0, query_len, tile_tokens)
        seqs += [seq] * len(tile_starts)
        starts += tile_starts
    host = torch.tensor([seqs, starts], dtype=torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def _unit_stride_head_dim(tensor: torch.Tensor) -> torch.Tensor:
    """Kernels take any token/head strides (a slice of a fused qkv output, say) but read head_dim whole."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
