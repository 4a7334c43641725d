"""The KV cache's layout: one K and one V tensor per layer, [num_blocks, block_size, num_kv_heads, head_dim]; with
several KV cache groups (kv_groups.py), one pair per slot, which layer j of every group shares."""

from __future__ import annotations

import torch

from pagedserve.engine.worker.kv_groups import KVCacheGroups
from pagedserve.engine.worker.models import KVCache, ModelSpec


def kv_cache_shape(spec: ModelSpec, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    """One layer's K (or V) cache. The runner allocates this shape, so block bytes are counted from it too."""
    return (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)


def allocate_kv_caches(
    spec: ModelSpec,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    groups: KVCacheGroups | None = None,
) -> list[KVCache]:
    """Zeroed K and V caches of every layer, in the layout kv_sizing counts bytes for (`spec`: a rank's). With
    `groups`, the layers of a slot share one pair of tensors (told apart by the blocks their groups own)."""
    shape = kv_cache_shape(spec, num_blocks, block_size)
    num_tensors = spec.num_layers if groups is None else groups.num_slots
    slots = [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_tensors)
    ]
    if groups is None:
        return slots
    slot_of_layer = groups.slot_of_layer()
    return [slots[slot_of_layer[layer]] for layer in range(spec.num_layers)]
