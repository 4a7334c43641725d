"""Paged attention as one of transformers' attention implementations ("pagedserve").

transformers' decoder modules compute their projections, norms and rotary embeddings themselves, then hand
query, key and value ([batch, heads, tokens, head_dim], RoPE already applied) to the function registered under
`config._attn_implementation`. Ours writes the new keys and values into the layer's paged cache (by the
module's `layer_idx`) and attends over the cache with the kernel backend, the way our own Llama layers do. The
step's metadata and caches reach it through a context set for the length of one forward (`paged_step`): the
modules between the model's forward and this function pass nothing of ours along.

A probe forward (`probe_attention`) records what each layer hands over, so the fallback learns the cache's shape
from the model itself and refuses what paged attention cannot compute (attention biases, soft-capping, sinks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedserve.kernels import AttentionMetadata, KernelBackend

ATTENTION_NAME = "pagedserve"
KVCache = tuple[torch.Tensor, torch.Tensor]
# Keyword arguments that change what attention computes, which the paged kernels cannot honour.
UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias", "attention_chunk_size")


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention handed over in the probe."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    sliding_window: int | None


@dataclass
class PagedStep:
    """One forward's batch (`metadata`), the caches by layer index, and the backend that runs the kernels."""

    metadata: AttentionMetadata
    kv_caches: Sequence[KVCache]
    backend: KernelBackend


@dataclass
class Probe:
    """Collects each layer's attention shapes (by layer index) during a probe forward."""

    layers: dict[int, LayerAttention] = field(default_factory=dict)


_current: ContextVar[PagedStep | Probe | None] = ContextVar("pagedserve_attention_step", default=None)


@contextlib.contextmanager
def paged_step(step: PagedStep | Probe) -> Iterator[None]:
    """Makes `step` the one the attention function serves until the block ends."""
    token = _current.set(step)
    try:
        yield
    finally:
        _current.reset(token)


def register_paged_attention() -> None:
    """Registers the function under ATTENTION_NAME (idempotent). transformers creates no attention mask for a
    name it has no mask function for: the paged kernels mask causally per sequence themselves."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention contract: query [1, H, T, D], key/value [1, KVH, T, D] of the flat batch's T
    tokens; returns ([1, T, H, D], no weights)."""
    step = _current.get()
    if step is None:
        raise RuntimeError("pagedserve attention runs only inside TransformersForCausalLM's forward")
    _check_supported(module, attention_mask, kwargs)
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int):
        raise ValueError(f"{type(module).__name__} has no layer_idx: its layer's cache cannot be found")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]: the kernels' layout
    if isinstance(step, Probe):
        step.layers[layer_idx] = LayerAttention(q.shape[1], k.shape[1], k.shape[2], v.shape[2], _window(kwargs))
        return query.new_zeros(1, q.shape[0], q.shape[1], v.shape[2]), None
    k_cache, v_cache = step.kv_caches[layer_idx]
    step.backend.write_kv(k, v, k_cache, v_cache, step.metadata.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window = _window(kwargs)  # each layer's own (a model may interleave windowed and global layers)
    out = step.backend.paged_attention(q.contiguous(), k_cache, v_cache, step.metadata, scale, sliding_window=window)
    return out.unsqueeze(0), None


def _check_supported(module: nn.Module, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
    name = type(module).__name__
    if attention_mask is not None:
        raise ValueError(f"{name} adds its own attention mask or bias (e.g. ALiBi), which paged attention cannot")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError(f"{name} attends bidirectionally; paged attention is causal")
    used = [key for key in UNSUPPORTED_KWARGS if kwargs.get(key) is not None]
    if used:
        raise ValueError(f"{name} uses {', '.join(used)} in attention, which paged attention does not compute")


def _window(kwargs: dict[str, Any]) -> int | None:
    window = kwargs.get("sliding_window")
    return int(window) if isinstance(window, int) and window > 0 else None
