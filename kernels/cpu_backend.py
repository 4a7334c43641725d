"""CPU backend: the kernel contract in torch, with native kernels (kernels/csrc) for float32.

Attention: the native kernel (kernels/cpu_native.py) reads the cache blocks in place and takes one query row
at a time over the tokens before it; the plan of which rows it takes, and the torch paths (gather + SDPA) for
the rest and for where it cannot run (no C compiler, another dtype), are in kernels/cpu_attention.py. New keys
and values go into the cache through another native kernel (torch's index_copy_ is slow on the strided views
the projections leave them in).

Dense ops: small batches compute their matmuls transposed and pass activations between layers feature-major
(see TRANSPOSED_GEMM_MAX_ROWS); decode batches' matmuls go to the skinny-matrix kernel (kernels/cpu_linear.py),
and the fused elementwise ops (kernels/cpu_layer_ops.py) read either layout in one pass. Where a native op
does not apply (another dtype, autograd, a layout it would misread) torch computes it.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.backend import KernelBackend, RotaryAngles
from pagedserve.kernels.cpu_attention import (
    AttentionPlan,
    decode_attention,
    plan_attention,
    prefill_attention,
    windowed_attention,
)
from pagedserve.kernels.cpu_layer_ops import LayerOps, heads_in_feature_order, is_dense_activation, layer_ops
from pagedserve.kernels.cpu_linear import SkinnyLinear, skinny_linear_applies, skinny_linear_kernel
from pagedserve.kernels.cpu_native import (
    VECTOR_LANES,
    DecodeAttention,
    WriteKV,
    decode_attention_kernel,
    write_kv_kernel,
)
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.quantized import QuantizedWeight, quantized_linear
from pagedserve.kernels.stacked_weight import ProjectionWeight, RowStackedWeight

# Batches of up to this many rows compute x @ W^T as (W @ x^T)^T: the same product, which MKL blocks better
# in that orientation when x has few rows. Measured on every projection of SmolLM2 (fp32, 2 cores,
# benchmarks/linear_orientation.py): 1.3-2.1x faster at 16-64 rows, 1.0-1.4x at 128-256, 0.9-1.2x at 2048.
# The result is a transposed view; the elementwise ops after it keep that layout and the next projection
# reads it as is.
TRANSPOSED_GEMM_MAX_ROWS = 256


class CpuBackend(KernelBackend):
    name = "cpu"
    # Activations of block-format products (kernels/quantized.py): "int8" where the engine's setting says so.
    activation_dtype = "float32"

    def __init__(self, native: bool = True) -> None:
        """native=False keeps every op on its torch path (the oracle the native kernels are tested against)."""
        self.native_decode: DecodeAttention | None = decode_attention_kernel() if native else None
        self.native_write_kv: WriteKV | None = write_kv_kernel() if native else None
        self.layer_ops: LayerOps | None = layer_ops() if native else None
        self.skinny_linear: SkinnyLinear | None = skinny_linear_kernel() if native else None

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.native_write_kv is not None and self.native_write_kv(key, value, k_cache, v_cache, slot_mapping):
            return
        slots = slot_mapping.long()
        valid = slots >= 0
        if not bool(valid.all()):
            slots, key, value = slots[valid], key[valid], value[valid]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        metadata.plan = plan_attention(metadata)
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
        plan: AttentionPlan = metadata.plan if metadata.plan is not None else plan_attention(metadata)
        # Contiguous, whatever layout the projections left the query in: the native kernel reads raw rows.
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        prefills = plan.prefills
        plain = sliding_window is None and soft_cap is None
        if self._runs_natively(query, k_cache, v_cache):
            prefills = plan.sdpa_prefills
            work = plan.native_rows
            if work.query_rows.numel():
                assert self.native_decode is not None
                self.native_decode(
                    out,
                    query.contiguous(),
                    k_cache,
                    v_cache,
                    metadata.block_tables,
                    work.context_lens,
                    work.seq_ids,
                    work.query_rows,
                    scale,
                    sliding_window,
                    soft_cap,
                )
        elif plain:
            for group in plan.decode_groups:
                decoded = decode_attention(query[group.rows], k_cache, v_cache, group, scale)
                out.index_copy_(0, group.rows, decoded)
        else:
            prefills = [*plan.decode_slices, *prefills]
        for piece in prefills:
            rows = slice(piece.query_begin, piece.query_end)
            if plain:
                out[rows] = prefill_attention(query[rows], k_cache, v_cache, piece, scale)
            else:
                out[rows] = windowed_attention(query[rows], k_cache, v_cache, piece, scale, sliding_window, soft_cap)
        return out

    def _runs_natively(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        caches_fit = k_cache.is_contiguous() and v_cache.is_contiguous()
        return (
            self.native_decode is not None
            and caches_fit
            and query.shape[-1] % VECTOR_LANES == 0
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (query, k_cache, v_cache))
        )

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not _feature_major(x):
            return super().linear(x, weight, bias)
        if self.skinny_linear is not None and skinny_linear_applies(x, weight):
            return self.skinny_linear(x, weight, bias)
        out = torch.mm(weight, x.t()).t()
        return out if bias is None else out + bias

    def quantized_linear(
        self, x: torch.Tensor, weight: ProjectionWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        parts = weight.row_ranges() if isinstance(weight, RowStackedWeight) else [(weight, 0, weight.shape[0])]
        products = [(part, start, stop) for part, start, stop in parts if isinstance(part, QuantizedWeight)]
        if len(products) != len(parts) or not _feature_major(x):
            return super().quantized_linear(x, weight, bias)
        out = torch.empty(weight.shape[0], x.shape[0]).t()  # feature-major, as linear() returns
        for part, start, stop in products:  # each part fills its own columns of one output
            part_bias = None if bias is None else bias[start:stop]
            quantized_linear(
                x, part, part_bias, out=out[:, start:stop], activation_dtype=self.activation_dtype,
                integer_tokens=self._integer_tokens(x),
            )  # fmt: skip
        return out

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | ProjectionWeight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):  # the kernel writes rows as they are asked for: no transposed copy
            tokens = self._integer_tokens(hidden)
            return quantized_linear(hidden, weight, activation_dtype=self.activation_dtype, integer_tokens=tokens)
        return super().logits(hidden, weight)

    def _integer_tokens(self, x: torch.Tensor) -> int:
        """The rows the choice of integer activations counts: x's without the step's proposed tokens."""
        return max(1, x.shape[0] - self.proposed_rows)

    def in_linear_output_layout(self, x: torch.Tensor) -> torch.Tensor:
        return x.t().contiguous().t() if _feature_major(x) else x

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ops = self._layer_ops_for(x) if is_dense_activation(x) else None
        if ops is not None:
            return ops.add_rms_norm(x, None, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The native op writes the sum into `residual` and reads both in one pass."""
        ops = self._layer_ops_for(x) if is_dense_activation(residual) and x.dim() == 2 else None
        if ops is not None:
            return ops.add_rms_norm(residual, x, weight, eps), residual
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        ops = self._layer_ops_for(gate_up)
        if ops is not None:
            return ops.silu_and_mul(gate_up)
        return super().silu_and_mul(gate_up)

    def rotary(self, angles: RotaryAngles, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In place where the native op applies: query and key are views into the qkv projection's output."""
        ops = self._layer_ops_for(query)
        if ops is not None and heads_in_feature_order(query) and heads_in_feature_order(key):
            halves = angles.token_major_halves if query.stride(-1) == 1 else angles.feature_major_halves
            ops.rotary(query, *halves)
            ops.rotary(key, *halves)
            return query, key
        return super().rotary(angles, query, key)

    def _layer_ops_for(self, x: torch.Tensor) -> LayerOps | None:
        """The native layer ops where they can run on x (float32 on the CPU, outside autograd), else None."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.requires_grad:
            return None
        return self.layer_ops


def _feature_major(x: torch.Tensor) -> bool:
    """Whether linear() computes x [T, in] transposed, returning a feature-major view (see above)."""
    return x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= TRANSPOSED_GEMM_MAX_ROWS
