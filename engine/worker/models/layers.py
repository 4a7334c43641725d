"""Building blocks of the Llama family: linear layers, RMSNorm, rotary embedding, gated MLP.

Their arithmetic runs on the kernel backend, which picks the fastest implementation for its device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.worker.distributed.group import TensorParallelGroup
from pagedserve.kernels import KernelBackend, RotaryAngles
from pagedserve.kernels.quantized import QuantizedWeight, lookup_rows
from pagedserve.kernels.stacked_weight import ProjectionWeight


class Linear(nn.Linear):
    """A projection whose weight is float, or kept in a quantized block format (`quantize_weight`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, backend: KernelBackend) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.backend = backend
        self.quantized: ProjectionWeight | None = None  # as the backend's place_quantized returned it

    def reset_parameters(self) -> None:
        # A weightless model (built on the meta device, weights/gguf.py) gets its tensors from a file; and torch's
        # random initializers run on meta tensors through its compiler, which needs a writable temporary folder.
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.backend.quantized_linear(x, self.quantized, self.bias)
        return self.backend.linear(x, self.weight, self.bias)

    @property
    def stored_weight(self) -> torch.Tensor | ProjectionWeight:
        """The weight as this layer multiplies by it: its blocks, or the float tensor."""
        return self.quantized if self.quantized is not None else self.weight

    def use_quantized(self, weight: ProjectionWeight) -> None:
        """Multiplies by `weight` from now on and drops the float copy."""
        if weight.shape != tuple(self.weight.shape):
            raise ValueError(f"a {weight.shape} weight cannot replace a {tuple(self.weight.shape)} one")
        self.quantized = weight
        self.weight = nn.Parameter(torch.empty(0, self.in_features), requires_grad=False)


class Embedding(nn.Embedding):
    """nn.Embedding, whose random initializer stands aside for a weightless model (see Linear.reset_parameters)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RowParallelLinear(Linear):
    """A projection whose input features are split across the ranks (Megatron's row-parallel layer): each rank
    multiplies its slice, one all-reduce adds the partial sums. Column-parallel layers need no class of their
    own: a rank's Linear just holds fewer output rows."""

    def __init__(self, in_features: int, out_features: int, backend: KernelBackend, group: TensorParallelGroup) -> None:
        super().__init__(in_features, out_features, bias=False, backend=backend)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


def projection(
    in_features: int, out_features: int, backend: KernelBackend, group: TensorParallelGroup | None
) -> Linear:
    """A bias-free projection back into the hidden size: row-parallel when the model is split."""
    if group is None:
        return Linear(in_features, out_features, bias=False, backend=backend)
    return RowParallelLinear(in_features, out_features, backend, group)


def vocab_rows_per_rank(vocab_size: int, size: int) -> int:
    """Rows of the embedding (and LM head) each rank holds: the vocabulary padded to a multiple of `size`."""
    return -(-vocab_size // size)


class VocabParallelEmbedding(nn.Module):
    """The embedding's rows split across the ranks: each looks up the ids in its range, zeros the rest, and an
    all-reduce assembles the rows (exactly: every sum has one non-zero term)."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.num_rows = vocab_rows_per_rank(vocab_size, group.size)
        self.first_row = group.rank * self.num_rows
        self.weight = nn.Parameter(torch.zeros(self.num_rows, hidden_size), requires_grad=False)
        self.group = group

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local, elsewhere = _local_ids(token_ids, self.first_row, self.num_rows)
        rows = F.embedding(local, self.weight)
        return self.group.all_reduce(rows.masked_fill_(elsewhere.unsqueeze(-1), 0.0))


def _local_ids(token_ids: torch.Tensor, first_row: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids as rows of a rank's slice of the vocabulary, 0 for ids elsewhere; where the ids are elsewhere)."""
    local = token_ids - first_row
    elsewhere = (local < 0) | (local >= num_rows)
    return local.masked_fill(elsewhere, 0), elsewhere


class QuantizedEmbedding(nn.Module):
    """A token embedding looked up in a table of blocks: GGUF files store it quantized, and a tied LM head
    multiplies by the same blocks, so no float copy of the table (113 MiB for SmolLM2) need exist. Split over
    `group`, the table is this rank's rows of the vocabulary, assembled as VocabParallelEmbedding does."""

    table: QuantizedWeight  # may be re-laid once loaded (engine/worker/kernel_layouts.py)

    def __init__(self, table: QuantizedWeight, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.table = table
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return lookup_rows(self.table, input_ids)
        num_rows = self.table.shape[0]
        local, elsewhere = _local_ids(input_ids, self.group.rank * num_rows, num_rows)
        rows = lookup_rows(self.table, local)
        return self.group.all_reduce(rows.masked_fill_(elsewhere.unsqueeze(-1), 0.0))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)

    def add_and_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x). The backend may write the sum into `residual` itself."""
        return self.backend.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, indexed by each token's position (the backend's
    `rotary` applies them)."""

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

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        backend: KernelBackend,
        group: TensorParallelGroup | None = None,
    ) -> None:
        """`intermediate_size`: this rank's share of the MLP width when the model is split over `group`."""
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False, backend=backend)
        self.down_proj = projection(intermediate_size, hidden_size, backend, group)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.silu_and_mul(self.gate_up_proj(x)))
