"""The kernel backend interface, and the choice between implementations.

A backend runs what a decoder layer computes: paged attention over the KV cache, and the dense ops around it
(projections, RMSNorm, SwiGLU, rotary embedding). The dense ops default to plain torch, which is what CUDA
runs; a backend overrides those it has something faster for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from pagedserve.kernels.device_blocks import AnyQuantizedWeight
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.quantized import FORMATS, QuantizedWeight, quantized_linear
from pagedserve.kernels.stacked_weight import ProjectionWeight, RowStackedWeight


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


class KernelBackend(ABC):
    """Writes new keys/values into the paged cache and attends over it (see DESIGN.md, kernel contract), and
    runs the dense ops of a layer on activations [tokens, features]."""

    name: str
    # True when a step's launches depend only on device tensors and what `prepare` planned, so a recorded
    # CUDA graph stays valid for any lengths (see engine/worker/cuda_graphs.py).
    supports_cuda_graphs: bool = False
    # Rows of this step's products that are proposed tokens (speculative decoding), set by the runner around a
    # step's forward and its sampling rows' head: the CPU backend leaves them out when it chooses between integer
    # and float32 activations, so that verifying rows multiply as plain decoding's would.
    proposed_rows: int = 0

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """Per-step host-side work shared by every layer; returns metadata with its `plan` filled."""
        return metadata

    def check_supported(self, dtype: torch.dtype, head_dim: int, block_size: int) -> None:  # noqa: B027
        """Raises ValueError, naming the offending value, for a shape or dtype this backend cannot run."""

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    @abstractmethod
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
        """Each new token over its sequence's cached tokens up to its own: only the last `sliding_window` of them
        (its own included) where that is set; scores soft-capped, soft_cap * tanh(score / soft_cap), where
        `soft_cap` is set (both per call: a model's layers differ)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] @ weight^T + bias, in whichever layout the backend returns (see in_linear_output_layout)."""
        return F.linear(x, weight, bias)

    def quantized_linear(
        self, x: torch.Tensor, weight: ProjectionWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """linear() with a weight in a quantized block format, as `place_quantized` returned it (or parts of
        them stacked by rows); same output layout."""
        if isinstance(weight, RowStackedWeight):
            products = [self.quantized_linear(x, part, _rows(bias, a, b)) for part, a, b in weight.row_ranges()]
            return torch.cat(products, dim=-1)
        if not isinstance(weight, QuantizedWeight):
            raise TypeError(f"the {self.name} backend multiplies CPU blocks, got a weight on {weight.device}")
        return quantized_linear(x, weight, bias)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | ProjectionWeight) -> torch.Tensor:
        """hidden [R, H] @ weight^T as dense token-major rows [R, V]: the LM head, whose rows the sampler reads."""
        if isinstance(weight, torch.Tensor):
            return self.linear(hidden, weight).contiguous()
        return self.quantized_linear(hidden, weight).contiguous()

    def quantized_formats(self, device: torch.device, dtype: torch.dtype) -> frozenset[str]:
        """The block formats quantized_linear multiplies on `device` with activations of `dtype`: by default
        all of them on the CPU in float32 (kernels/quantized.py), none elsewhere."""
        return frozenset(FORMATS) if device.type == "cpu" and dtype == torch.float32 else frozenset()

    def place_quantized(self, weight: QuantizedWeight, device: torch.device) -> AnyQuantizedWeight:
        """`weight` as quantized_linear reads it on `device` (one of quantized_formats'): the CPU kernels read
        the blocks as GGUF stores them."""
        return weight

    def in_linear_output_layout(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, F] laid out the way linear() returns its outputs, so that the residual stream and the layer
        outputs added to it share one layout."""
        return x

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x). A backend may write the sum into `residual` itself."""
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up for gate_up = [gate | up], [T, 2I] -> [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GELU(gate, tanh approximation) * up for gate_up = [gate | up], [T, 2I] -> [T, I] (Gemma's MLP)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rotary(self, angles: RotaryAngles, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, D], key [T, KVH, D] rotated by their positions' angles. A backend may rotate in place."""
        cos = angles.cos.unsqueeze(1).to(query.dtype)
        sin = angles.sin.unsqueeze(1).to(query.dtype)
        return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 and cast back before the weight, exactly as transformers does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rows(bias: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if bias is None else bias[start:stop]
