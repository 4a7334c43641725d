"""The KV cache's layout: one K and one V tensor per layer, [num_blocks, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

import torch

from pagedserve.engine.worker.models import KVCache, ModelSpec


def kv_cache_shape(spec: ModelSpec, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    """One layer's K (or V) cache. The runner allocates this shape, so block bytes are counted from it too."""
    return (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)


def allocate_kv_caches(
    spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[KVCache]:
    """Zeroed K and V caches of every layer, in the layout kv_sizing counts bytes for (`spec`: a rank's)."""
    shape = kv_cache_shape(spec, num_blocks, block_size)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(spec.num_layers)
    ]
