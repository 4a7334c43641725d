"""Building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.kernels.cpu_layer_ops import heads_in_feature_order, is_dense_activation, layer_ops_for
from pagedserve.kernels.cpu_linear import skinny_linear_for

# On CPU, batches of up to this many rows compute x @ W^T as (W @ x^T)^T: the same product, which MKL blocks
# better in that orientation when x has few rows. Measured on every projection of SmolLM2 (fp32, 2 cores,
# benchmarks/linear_orientation.py): 1.3-2.1x faster at 16-64 rows, 1.0-1.4x at 128-256, 0.9-1.2x at 2048.
# The result is a transposed view; the elementwise ops after it keep that layout and the next projection
# reads it as is.
TRANSPOSED_GEMM_MAX_ROWS = 256


def _feature_major_on_cpu(x: torch.Tensor) -> bool:
    """Whether linear() computes x [T, in] transposed, returning a feature-major view (see above)."""
    return x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= TRANSPOSED_GEMM_MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for x [T, in], in whichever orientation is faster on x's device (see above)."""
    if not _feature_major_on_cpu(x):
        return F.linear(x, weight, bias)
    skinny = skinny_linear_for(x, weight)
    if skinny is not None:
        return skinny(x, weight, bias)
    out = torch.mm(weight, x.t()).t()
    return out if bias is None else out + bias


def in_linear_output_layout(x: torch.Tensor) -> torch.Tensor:
    """x [T, F] laid out the way linear() returns its outputs, so that the residual stream and the layer
    outputs added to it share one layout (the fused CPU ops then read both in one pass)."""
    if not _feature_major_on_cpu(x):
        return x
    return x.t().contiguous().t()


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = layer_ops_for(x) if is_dense_activation(x) else None
        if ops is not None:
            return ops.add_rms_norm(x, None, self.weight, self.eps)
        return self._normalize(x)

    def add_and_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x). On the CPU the sum is written into `residual` itself."""
        ops = layer_ops_for(x) if is_dense_activation(residual) and x.dim() == 2 else None
        if ops is not None:
            return ops.add_rms_norm(residual, x, self.weight, self.eps), residual
        residual = residual + x
        return self._normalize(residual), residual

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, exactly as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


@dataclass
class RotaryAngles:
    """cos and sin of one step's positions, looked up once and shared by every layer."""

    cos: torch.Tensor  # [T, head_dim]: each frequency twice, as transformers' tables hold it
    sin: torch.Tensor

    @cached_property
    def token_major_halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, head_dim / 2] each: the fused CPU op's tables for token-major activations."""
        half = self.cos.shape[-1] // 2
        return self.cos[:, :half].contiguous(), self.sin[:, :half].contiguous()

    @cached_property
    def feature_major_halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[head_dim / 2, T] each: the tables for feature-major activations."""
        cos, sin = self.token_major_halves
        return cos.t().contiguous(), sin.t().contiguous()


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, indexed by each token's position."""

    def __init__(self, head_dim: int, max_positions: int, rope_parameters: dict[str, Any], hf_config: Any) -> None:
        super().__init__()
        inv_freq, attention_scaling = _inverse_frequencies(head_dim, rope_parameters, hf_config)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def angles(self, positions: torch.Tensor) -> RotaryAngles:
        return RotaryAngles(self.cos[positions], self.sin[positions])

    def forward(
        self, angles: RotaryAngles, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, D], key [T, KVH, D] rotated by their positions' angles; on the CPU in place."""
        ops = layer_ops_for(query)
        if ops is not None and heads_in_feature_order(query) and heads_in_feature_order(key):
            halves = angles.token_major_halves if query.stride(-1) == 1 else angles.feature_major_halves
            ops.rotary(query, *halves)
            ops.rotary(key, *halves)
            return query, key
        cos = angles.cos.unsqueeze(1).to(query.dtype)
        sin = angles.sin.unsqueeze(1).to(query.dtype)
        return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _inverse_frequencies(head_dim: int, rope_parameters: dict[str, Any], hf_config: Any) -> tuple[torch.Tensor, float]:
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        theta = rope_parameters.get("rope_theta", 10000.0)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        return 1.0 / (theta**exponents), 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic RoPE scaling depends on the sequence length and is not supported")
    # Scaled variants (llama3, linear, yarn, longrope): transformers owns the formulas.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class GatedMLP(nn.Module):
    """SwiGLU with gate and up projections fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = layer_ops_for(gate_up)
        if ops is not None:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
