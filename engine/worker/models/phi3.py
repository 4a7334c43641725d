"""Phi-3 and Phi-4-mini (Phi3ForCausalLM): the Llama decoder with fused checkpoint tensors and Phi's RoPE.

The checkpoint stores q/k/v as one qkv_proj and gate/up as one gate_up_proj, the order our Llama fuses them
in. Each fused tensor is cut into its parts as it loads, so the parts go through Llama's loading (and, split
over ranks, each rank keeps its heads' rows of each part); the query and key rows are permuted for partial
rotary dimensions (partial_rope.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedserve.engine.worker.models.llama import CheckpointSlice, LlamaForCausalLM, rank_slice
from pagedserve.engine.worker.models.partial_rope import permute_heads, rotary_dim
from pagedserve.engine.worker.models.spec import ModelSpec

FUSED_MODULES = ("self_attn.qkv_proj", "mlp.gate_up_proj")


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        split = None if self.group is None else (self.group.rank, self.group.size)
        super().load_weights(unfused_weights(weights, self.spec, split))

    def checkpoint_slice(self, hf_name: str) -> CheckpointSlice | None:
        """Fused tensors are read whole and cut here (their parts' rows are not one range)."""
        if _fused_module(hf_name) is not None:
            return None
        return super().checkpoint_slice(hf_name)


def unfused_weights(
    weights: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec, split: tuple[int, int] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with qkv_proj and gate_up_proj as Llama's q/k/v_proj and gate/up_proj (query and
    key rows in our head order); `split`: (rank, size) keeps only that rank's rows of each part."""
    rotated = rotary_dim(spec.head_dim, spec.rope_parameters)
    for name, tensor in weights:
        module = _fused_module(name)
        if module is None:
            yield name, tensor
            continue
        prefix = name.removesuffix(f"{module}.weight")
        for part, rows in _parts(module, tensor, spec).items():
            if part in ("self_attn.q_proj", "self_attn.k_proj") and rotated < spec.head_dim:
                rows = permute_heads(rows, spec.head_dim, rotated)
            part_name = f"{prefix}{part}.weight"
            yield part_name, _rank_rows(part_name, rows, spec, split)


def _fused_module(name: str) -> str | None:
    return next((m for m in FUSED_MODULES if name.endswith(f"{m}.weight")), None)


def _parts(module: str, tensor: torch.Tensor, spec: ModelSpec) -> dict[str, torch.Tensor]:
    if module == "mlp.gate_up_proj":
        gate, up = tensor.split(spec.intermediate_size)
        return {"mlp.gate_proj": gate, "mlp.up_proj": up}
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    query, key, value = tensor.split([q, kv, kv])
    return {"self_attn.q_proj": query, "self_attn.k_proj": key, "self_attn.v_proj": value}


def _rank_rows(name: str, rows: torch.Tensor, spec: ModelSpec, split: tuple[int, int] | None) -> torch.Tensor:
    if split is None:
        return rows
    part = rank_slice(name, spec, *split)
    assert part is not None and part[0] == 0, f"{name} is split by output rows"
    return rows[part[1] : part[2]]


def fused_row_order(module: str, spec: ModelSpec, split: tuple[int, int] | None) -> torch.Tensor:
    """The stored row of each row of our fused `module` ("self_attn.qkv_proj", "mlp.gate_up_proj") that this
    rank holds: its rows of each part, the query and key rows in our head order (a GGUF file's attn_qkv and
    ffn_up are read through it, blocks as stored)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    total = q + 2 * kv if module == "self_attn.qkv_proj" else 2 * spec.intermediate_size
    rows = torch.arange(total).unsqueeze(1)  # row ids cut as the rows themselves are
    parts = unfused_weights([(f"model.layers.0.{module}.weight", rows)], spec, split)
    return torch.cat([part for _, part in parts]).squeeze(1)
