"""Paged KV-cache kernels: `write_kv` and `paged_attention`, one contract, several backends (each also runs the
dense ops of a decoder layer: see KernelBackend).

KV cache per layer: `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import torch

from pagedserve.kernels.backend import KernelBackend, RotaryAngles
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.selection import BACKEND_NAMES, get_backend, resolve_backend_name

__all__ = [
    "BACKEND_NAMES",
    "AttentionMetadata",
    "KernelBackend",
    "RotaryAngles",
    "get_backend",
    "paged_attention",
    "resolve_backend_name",
    "write_kv",
]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Scatters key/value [num_tokens, num_kv_heads, head_dim] into the cache; slots < 0 are skipped."""
    get_backend(backend, key.device).write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    backend: str = "auto",
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over all its cached tokens (the last `sliding_window` of
    them where set, scores soft-capped at `soft_cap` where set); returns [T, H, D].

    A convenience entry point that plans on the spot; the engine builds one `AttentionMetadata` per step
    and calls the backend directly so that all layers share the plan.
    """
    impl = get_backend(backend, query.device)
    metadata = AttentionMetadata.from_tensors(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    return impl.paged_attention(query, k_cache, v_cache, impl.prepare(metadata), scale, sliding_window, soft_cap)
