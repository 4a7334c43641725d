"""OLMoE's attention: Llama's, with q and k RMS-normalised over the whole projection rather than per head."""

from __future__ import annotations

import dataclasses

import torch

from pagedserve.engine.worker.distributed.group import TensorParallelGroup
from pagedserve.engine.worker.models.layers import RMSNorm
from pagedserve.engine.worker.models.llama import LlamaAttention
from pagedserve.engine.worker.models.spec import ModelSpec
from pagedserve.kernels import AttentionMetadata, KernelBackend, RotaryAngles


class WholeProjectionNormAttention(LlamaAttention):
    """q [T, heads * head_dim] and k normalised as one vector each per token (every head at once), before they are
    split into heads; then q, k and v clamped to +-clip_qkv where the checkpoint says so. Split over ranks, each
    holds some heads: the sum of squares is all-reduced so every rank divides by the whole projection's mean."""

    def __init__(
        self, spec: ModelSpec, backend: KernelBackend, group: TensorParallelGroup | None, clip_qkv: float | None
    ) -> None:
        super().__init__(dataclasses.replace(spec, qk_norm=False), backend, group)
        self.q_norm = RMSNorm(self.q_size, spec.rms_norm_eps, backend)
        self.k_norm = RMSNorm(self.kv_size, spec.rms_norm_eps, backend)
        self.group = group
        self.clip_qkv = clip_qkv

    def forward(self, angles: RotaryAngles, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        assert self.q_norm is not None and self.k_norm is not None
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._normalized(q, self.q_norm), self._normalized(k, self.k_norm)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.backend.rotary(angles, q, k)
        assert self.kv_cache is not None, "bind_kv_caches() before the first forward"
        k_cache, v_cache = self.kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = self.backend.paged_attention(q, k_cache, v_cache, metadata, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))

    def _normalized(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        if self.group is None:
            return self.backend.rms_norm(x, norm.weight, norm.eps)
        # Each rank holds x.shape[-1] features (KV heads replicated over ranks count once per copy, and so do
        # their features in the divisor): the mean of squares over the whole projection.
        x32 = x.float()
        squares = self.group.all_reduce(x32.pow(2).sum(-1, keepdim=True))
        mean = squares / (x.shape[-1] * self.group.size)
        return norm.weight * (x32 * torch.rsqrt(mean + norm.eps)).to(x.dtype)
