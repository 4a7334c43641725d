"""A GGUF file's experts (llama.cpp's qwen3moe and llama-MoE layouts) read straight into a MoE model.

llama.cpp stores a layer's experts as three 3-D tensors, ffn_gate_exps and ffn_up_exps [experts, intermediate,
hidden] and ffn_down_exps [experts, hidden, intermediate] (torch's order), each expert's rows one run of blocks;
the router is ffn_gate_inp [experts, hidden]. Where the backend multiplies the format here, every expert keeps
its blocks as stored (gate and up stacked by rows, as gguf.py fuses gate/up); elsewhere the experts are float.
Split over tensor-parallel ranks, a rank reads every expert's slice of the intermediate width: gate/up rows,
down columns (whole blocks only where the slice falls on block boundaries; else float).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from pagedserve.engine.worker.models.moe import MoeForCausalLM
from pagedserve.engine.worker.models.moe_blocks import SparseMoeBlock
from pagedserve.engine.worker.weights.block_shards import CheckpointSlice, on_block_boundaries, read_shard
from pagedserve.engine.worker.weights.gguf_index import StoredTensor
from pagedserve.kernels.device_blocks import AnyQuantizedWeight
from pagedserve.kernels.moe import ExpertWeight
from pagedserve.kernels.quantized import QuantizedWeight
from pagedserve.kernels.stacked_weight import RowStackedWeight

ROLES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
Place = Callable[[QuantizedWeight], AnyQuantizedWeight]
Put = Callable[[str, torch.Tensor], None]


class TensorReader(Protocol):
    """What is read of a GGUF file (weights/gguf.py: GGUFTensors)."""

    file: Path

    def get(self, name: str) -> StoredTensor: ...
    def qtype(self, name: str) -> str | None: ...
    def float(self, name: str, role: str | None = None) -> torch.Tensor: ...


class ExpertTensors:
    """One layer's three expert tensors in a GGUF file, read as a rank's slices."""

    def __init__(self, tensors: TensorReader, layer: int, split: tuple[int, int] | None) -> None:
        self.tensors = tensors
        self.stored = [tensors.get(f"blk.{layer}.{role}.weight") for role in ROLES]
        self.qtypes = [tensors.qtype(t.name) for t in self.stored]
        self.split = split

    def part(self, role_index: int) -> CheckpointSlice | None:
        """The rank's slice of one expert's weight: gate/up rows, down columns."""
        if self.split is None:
            return None
        rank, size = self.split
        width = self.stored[0].shape[1] // size
        return (1 if role_index == 2 else 0), rank * width, (rank + 1) * width

    def blocks_apply(self, formats: frozenset[str]) -> bool:
        return all(q is not None and q in formats for q in self.qtypes) and all(
            on_block_boundaries(self.part(i), q) for i, q in enumerate(self.qtypes) if q is not None
        )

    def blocks(self, role_index: int) -> list[QuantizedWeight]:
        """Every expert's blocks of one role, as stored (its rank's slice)."""
        tensor, qtype = self.stored[role_index], self.qtypes[role_index]
        assert qtype is not None
        experts = tensor.shape[0]
        stored = _mapped(self.tensors.file, tensor).reshape(experts, -1)
        shape, part = (tensor.shape[1], tensor.shape[2]), self.part(role_index)
        return [read_shard(stored[e], qtype, shape, part) for e in range(experts)]

    def floats(self, role_index: int) -> torch.Tensor:
        """[experts, out, in] float32, dequantized where stored in blocks (its rank's slice)."""
        values = self.tensors.float(self.stored[role_index].name)
        part = self.part(role_index)
        if part is None:
            return values
        dim, start, stop = part
        return values.narrow(dim + 1, start, stop - start).contiguous()


def load_gguf_experts(model: object, tensors: TensorReader, formats: frozenset[str], place: Place, put: Put) -> None:
    """Every MoE layer's router and experts from the file (nothing for a model without experts)."""
    if not isinstance(model, MoeForCausalLM):
        return
    split = None if model.group is None else (model.group.rank, model.group.size)
    for index, layer in enumerate(model.layers):
        block = layer.mlp
        if not isinstance(block, SparseMoeBlock):
            continue
        experts = ExpertTensors(tensors, index, split)
        put(f"layers.{index}.mlp.gate.weight", experts.tensors.float(f"blk.{index}.ffn_gate_inp.weight"))
        if block.shared_expert is not None:  # its projections are read with the dense ones (gguf.py: FUSED)
            shared_gate = experts.tensors.float(f"blk.{index}.ffn_gate_inp_shexp.weight")
            put(f"layers.{index}.mlp.shared_expert_gate.weight", shared_gate.reshape(1, -1))
        if experts.blocks_apply(formats):
            gate, up, down = (experts.blocks(i) for i in range(3))
            gate_up: list[ExpertWeight] = [_placed_pair(g, u, place) for g, u in zip(gate, up, strict=True)]
            block.experts.use_quantized(gate_up, [place(d) for d in down])
            continue
        gate_floats, up_floats, down_floats = (experts.floats(i) for i in range(3))
        put(f"layers.{index}.mlp.experts.gate_up_proj", torch.cat([gate_floats, up_floats], dim=1).flatten(0, 1))
        put(f"layers.{index}.mlp.experts.down_proj", down_floats.flatten(0, 1))


def _placed_pair(gate: QuantizedWeight, up: QuantizedWeight, place: Place) -> ExpertWeight:
    """gate's rows, then up's: one run of blocks where they share a format."""
    if gate.qtype != up.qtype:
        return RowStackedWeight((place(gate), place(up)))
    stacked = torch.cat([gate.blocks, up.blocks])
    return place(QuantizedWeight(gate.qtype, stacked, (stacked.shape[0], gate.shape[1])))


def _mapped(file: Path, tensor: StoredTensor) -> np.ndarray:
    return np.memmap(file, np.uint8, "r", offset=tensor.offset, shape=(tensor.nbytes,))
