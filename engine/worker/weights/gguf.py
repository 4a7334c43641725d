"""A GGUF file's tensors read straight into the model, as the kernels take them.

The model is built on the meta device (no memory), then each parameter gets its tensor from the file:
- a projection whose stored format the backend multiplies on this device keeps its blocks as stored (a memory
  map of the file, copied once into the kernels' layout): q/k/v and gate/up fused by stacking rows (a block never
  spans rows); parts of different formats (a Q4_K_M file's q and k in Q4_K, v in Q6_K) stay apart and multiply
  as separate products (kernels/stacked_weight.py);
- the token embedding keeps its blocks too where the CPU looks rows up in them (and a tied head multiplies by
  the same blocks);
- norms, biases and what the backend does not multiply in blocks (another device, quantization "none", a
  tensor-parallel slice that splits blocks) are float: F32/F16/BF16 tensors as stored, block tensors
  dequantized one at a time by gguf-py.
No float copy of the model exists at any point: the peak is the blocks plus one tensor.

llama.cpp's converter permutes the rows of Llama-architecture q and k weights (its RoPE pairs neighbouring
features, transformers' pairs halves): the rows are put back in transformers' order as they are read.

Split over tensor-parallel ranks, each rank reads only its shard of each tensor (weights/block_shards.py),
sliced as LlamaForCausalLM.checkpoint_slice slices float checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedserve.engine.worker.models import LlamaForCausalLM, ModelSpec
from pagedserve.engine.worker.models.layers import QuantizedEmbedding, vocab_rows_per_rank
from pagedserve.engine.worker.models.llama import rank_slice
from pagedserve.engine.worker.models.phi3 import fused_row_order
from pagedserve.engine.worker.weights.block_shards import CheckpointSlice, on_block_boundaries, read_shard
from pagedserve.engine.worker.weights.gguf_index import StoredTensor, TensorIndex
from pagedserve.engine.worker.weights.gguf_moe import load_gguf_experts
from pagedserve.kernels.device_blocks import AnyQuantizedWeight
from pagedserve.kernels.quantized import FORMATS, QuantizedWeight
from pagedserve.kernels.stacked_weight import ProjectionWeight, RowStackedWeight

logger = logging.getLogger(__name__)

PERMUTED_ARCHITECTURES = frozenset({"llama"})  # whose q/k rows llama.cpp's converter permutes
TYPE_NAMES = {fmt.ggml_type: name for name, fmt in FORMATS.items()}
FLOAT_TYPES = {0: np.float32, 1: np.float16, 30: np.uint16}  # F32, F16, BF16 (read as its bits)
NOT_HERE, OFF_BLOCKS = "not multiplied here", "off blocks"  # why a projection stays float
Split = tuple[int, int]  # (rank, size): a tensor-parallel rank's shard; None for the whole model
Place = Callable[[QuantizedWeight], AnyQuantizedWeight]  # blocks as the backend reads them on the device
# Our fused projection -> the GGUF tensors stacked into it, in order.
FUSED = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
    "mlp.shared_expert.gate_up_proj": ("ffn_gate_shexp", "ffn_up_shexp"),  # Qwen2-MoE's (where a model has one)
    "mlp.shared_expert.down_proj": ("ffn_down_shexp",),
}
# Phi-3 stores q/k/v as one tensor and gate/up as one: read whole, their rows put in our order per rank
# (models/phi3.py: fused_row_order).
PHI3_FUSED = {
    "self_attn.qkv_proj": ("attn_qkv",),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_up",),
    "mlp.down_proj": ("ffn_down",),
}
PHI3_ROWS = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # role -> our fused module
PART_MODULES = {  # a GGUF role -> the transformers module its checkpoint tensor belongs to
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
SHARED_EXPERT_MODULES = {  # the same for Qwen2-MoE's shared expert
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
LAYER_FLOATS = {  # our parameter in layer N -> its GGUF tensor in block N
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}


class GGUFTensors:
    """Reads tensors of one GGUF file (by its index), whole or as a rank's shard, in our row order."""

    def __init__(
        self,
        gguf_file: Path,
        index: TensorIndex,
        spec: ModelSpec,
        split: Split | None,
        checkpoint_slice: Callable[[str], CheckpointSlice | None] | None = None,
    ) -> None:
        """`checkpoint_slice`: the model's own rule for the rank's part of a transformers checkpoint tensor (by
        default, the dense Llama rule: an MoE model's shared expert has a width of its own)."""
        self.file, self.tensors, self.spec, self.split = gguf_file, index.tensors, spec, split
        self.checkpoint_slice = checkpoint_slice or (lambda name: rank_slice(name, spec, *split) if split else None)
        self.permuted = index.architecture in PERMUTED_ARCHITECTURES
        self.fused_rows = PHI3_ROWS if spec.architecture == "Phi3ForCausalLM" else {}

    def get(self, name: str) -> StoredTensor:
        if name not in self.tensors:
            raise ValueError(f"{self.file.name} holds no tensor {name!r}: not a {self.spec.architecture} model")
        return self.tensors[name]

    def qtype(self, name: str) -> str | None:
        """The block format a tensor is stored in, where it is one the kernels know."""
        return TYPE_NAMES.get(self.get(name).ggml_type)

    def blocks(self, name: str, role: str) -> QuantizedWeight:
        """A block tensor (of a format the kernels know) as stored, in our row order: this rank's shard."""
        tensor, qtype = self.get(name), self.qtype(name)
        assert qtype is not None
        out_features, in_features = tensor.shape
        num_rows = vocab_rows_per_rank(self.spec.vocab_size, self.split[1]) if _vocab(role) and self.split else None
        stored = self._bytes(tensor)
        try:
            return read_shard(
                stored,
                qtype,
                (out_features, in_features),
                self.slice(name, role),
                self._order(role, out_features),
                num_rows,
            )
        finally:
            del stored  # unmapped: the process keeps only the copy

    def float(self, name: str, role: str | None = None) -> torch.Tensor:
        """A tensor in float32, dequantized if it is stored in blocks: this rank's shard (where `role` names a
        sharded one), rows in our order."""
        tensor = self.get(name)
        values = torch.from_numpy(self._dequantized(tensor)).reshape(tensor.shape)
        if role is None:
            return values
        order = self._order(role, tensor.shape[0])
        if order is not None:
            values = values[torch.from_numpy(order)]
        part = self.slice(name, role)
        if part is not None:
            dim, start, stop = part
            values = values.narrow(dim, start, stop - start)
        if _vocab(role) and self.split is not None:
            values = _pad_rows(values, vocab_rows_per_rank(self.spec.vocab_size, self.split[1]))
        return values.contiguous()

    def slice(self, name: str, role: str) -> CheckpointSlice | None:
        """The rank's slice of a tensor: the one its float twin in a transformers checkpoint is read with."""
        if self.split is None:
            return None
        if _vocab(role):
            return rank_slice("lm_head.weight", self.spec, *self.split)
        if role in self.fused_rows:
            return None  # the rank's rows are picked by _order
        layer, kind = name.split(".")[1], name.rsplit(".", 1)[1]  # "blk.3.attn_q.weight"
        module = PART_MODULES.get(role) or SHARED_EXPERT_MODULES[role]
        return self.checkpoint_slice(f"model.layers.{layer}.{module}.{kind}")

    def _order(self, role: str, num_rows: int) -> np.ndarray | None:
        if role in self.fused_rows:
            return fused_row_order(self.fused_rows[role], self.spec, self.split).numpy()
        heads = {"attn_q": self.spec.num_heads, "attn_k": self.spec.num_kv_heads}.get(role)
        return _unpermuted_rows(num_rows, heads) if self.permuted and heads is not None else None

    def _bytes(self, tensor: StoredTensor) -> np.ndarray:
        return np.memmap(self.file, np.uint8, "r", offset=tensor.offset, shape=(tensor.nbytes,))

    def _dequantized(self, tensor: StoredTensor) -> np.ndarray:
        stored = self._bytes(tensor)
        if tensor.ggml_type in FLOAT_TYPES:
            values = stored.view(FLOAT_TYPES[tensor.ggml_type])
            if tensor.ggml_type == 30:  # bfloat16: the high half of a float32
                return (values.astype(np.uint32) << 16).view(np.float32)
            return values.astype(np.float32)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = stored.reshape(tensor.shape[0], -1)
        return dequantize(rows, GGMLQuantizationType(tensor.ggml_type)).astype(np.float32, copy=False)


def load_gguf_weights(
    model: LlamaForCausalLM,
    tensors: GGUFTensors,
    formats: frozenset[str],
    place: Place,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Gives every parameter of `model` (built on the meta device) its tensor from the file: the projections in
    `formats` as blocks (`place`d for the device), the rest float in `dtype` on `device`."""

    def put(name: str, values: torch.Tensor) -> None:
        _assign(model, name, values.to(device=device, dtype=dtype))

    kept_float: dict[str, str] = {}  # module -> its parts' types, where the backend multiplies none of them here
    off_blocks: dict[str, str] = {}  # module -> its type, where a rank's input columns split its blocks
    for module, parts in _projections(model):
        weight = _blocks_of(tensors, parts, formats)
        if isinstance(weight, str):
            type_names = "+".join(dict.fromkeys(_type_name(tensors.get(n)) for n, _ in parts))
            (off_blocks if weight == OFF_BLOCKS else kept_float)[module] = type_names
            put(f"{module}.weight", torch.cat([tensors.float(n, role) for n, role in parts]))
        else:
            model.use_quantized({module: _placed(weight, place)})
    _load_embedding_and_head(model, tensors, formats, place, put)
    load_gguf_experts(model, tensors, formats, place, put)
    for name, values in _float_tensors(tensors, model.spec, getattr(model, "gguf_layer_floats", LAYER_FLOATS)):
        put(name, values)
    if kept_float:
        logger.info("%d projections multiply in float: %s", len(kept_float), _grouped(kept_float))
    if off_blocks and tensors.split is not None:
        rank, size = tensors.split
        spec = model.spec
        logger.info(
            "%d row-parallel projections multiply in float on rank %d of %d: a rank's input columns (attention %d, "
            "MLP %d) do not fall on their format's blocks (32 weights, 256 for K-quants): %s",
            len(off_blocks),
            rank,
            size,
            spec.num_heads * spec.head_dim // size,
            spec.intermediate_size // size,
            _grouped(off_blocks),
        )
    missing = [name for name, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing:
        raise ValueError(f"the GGUF file left {len(missing)} tensors of the model unset, e.g. {missing[:3]}")


def _blocks_of(tensors: GGUFTensors, parts: list[tuple[str, str]], formats: frozenset[str]) -> ProjectionWeight | str:
    """The parts' blocks stacked by rows (one weight where they share a format), or why they stay float:
    NOT_HERE where a part's format is not multiplied here, OFF_BLOCKS where a rank's slice of it splits blocks."""
    qtypes = [tensors.qtype(name) for name, _ in parts]
    if any(q is None or q not in formats for q in qtypes):
        return NOT_HERE
    if not all(on_block_boundaries(tensors.slice(n, r), q) for (n, r), q in zip(parts, qtypes)):  # type: ignore[arg-type]
        return OFF_BLOCKS
    shards = [tensors.blocks(name, role) for name, role in parts]
    if len(set(qtypes)) > 1:
        return RowStackedWeight(tuple(shards))
    if len(shards) == 1:
        return shards[0]
    blocks = torch.cat([w.blocks for w in shards])
    return QuantizedWeight(shards[0].qtype, blocks, (blocks.shape[0], shards[0].shape[1]))


def _placed(weight: ProjectionWeight, place: Place) -> ProjectionWeight:
    if isinstance(weight, RowStackedWeight):
        return RowStackedWeight(tuple(place(part) for part in weight.parts))  # type: ignore[arg-type]
    assert isinstance(weight, QuantizedWeight)
    return place(weight)


def _load_embedding_and_head(
    model: LlamaForCausalLM,
    tensors: GGUFTensors,
    formats: frozenset[str],
    place: Place,
    put: Callable[[str, torch.Tensor], None],
) -> None:
    """The embedding looks rows up in token_embd's blocks where the CPU can (else float); a tied head
    multiplies by those blocks, an untied one by output's."""
    table_type = tensors.qtype("token_embd.weight")
    table = tensors.blocks("token_embd.weight", "token_embd") if table_type in formats else None
    placed_table = None if table is None else place(table)
    if isinstance(placed_table, QuantizedWeight):  # CPU blocks: lookups read them
        model.embed_tokens = QuantizedEmbedding(placed_table, model.group)
    else:
        put("embed_tokens.weight", tensors.float("token_embd.weight", "token_embd"))
    if model.lm_head is None:
        model.quantized_head = placed_table
        return
    head = _blocks_of(tensors, [("output.weight", "output")], formats)
    if isinstance(head, str):
        put("lm_head.weight", tensors.float("output.weight", "output"))
    else:
        model.use_quantized({"lm_head": _placed(head, place)})


def _projections(model: LlamaForCausalLM) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """Each of our projections with the GGUF tensors (name, role) stacked into it, in order (a layer of experts
    has no dense MLP: weights/gguf_moe.py reads it)."""
    modules = dict(model.named_modules())
    fused = PHI3_FUSED if model.spec.architecture == "Phi3ForCausalLM" else FUSED
    for layer in range(model.spec.num_layers):
        for module, roles in fused.items():
            if f"layers.{layer}.{module}" in modules:
                yield f"layers.{layer}.{module}", [(f"blk.{layer}.{role}.weight", role) for role in roles]


def _float_tensors(
    tensors: GGUFTensors, spec: ModelSpec, layer_floats: dict[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Our float parameters besides projections and the embedding: norms, q/k norms (`layer_floats`: their GGUF
    names, LAYER_FLOATS but for a model that names its own), the q/k/v bias."""
    yield "norm.weight", tensors.float("output_norm.weight")
    for layer in range(spec.num_layers):
        for ours, theirs in layer_floats.items():
            if f"blk.{layer}.{theirs}" in tensors.tensors:
                yield f"layers.{layer}.{ours}", tensors.float(f"blk.{layer}.{theirs}")
        if spec.qkv_bias:
            roles = FUSED["self_attn.qkv_proj"]
            bias = [tensors.float(f"blk.{layer}.{role}.bias", role) for role in roles]
            yield f"layers.{layer}.self_attn.qkv_proj.bias", torch.cat(bias)


def _assign(model: nn.Module, name: str, values: torch.Tensor) -> None:
    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = getattr(module, attribute)
    if tuple(current.shape) != tuple(values.shape):
        raise ValueError(f"{name}: the file's shape {tuple(values.shape)} != the model's {tuple(current.shape)}")
    setattr(module, attribute, nn.Parameter(values, requires_grad=False))


def _vocab(role: str) -> bool:
    return role in ("token_embd", "output")


def _pad_rows(values: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The last rank's share of a padded vocabulary: zero rows past the file's."""
    if len(values) >= num_rows:
        return values
    return torch.cat([values, values.new_zeros(num_rows - len(values), *values.shape[1:])])


def _unpermuted_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute_weights on row ids)."""
    half = num_rows // num_heads // 2
    rows = np.arange(num_rows).reshape(num_heads, half, 2)
    return rows.swapaxes(2, 1).reshape(num_rows)


def _type_name(tensor: StoredTensor) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(tensor.ggml_type).name


def _grouped(reasons: dict[str, str]) -> str:
    """Modules by reason: 'Q4_K+Q6_K: layers.0.self_attn.qkv_proj, ...; Q5_0: ...'."""
    by_reason: dict[str, list[str]] = {}
    for module, reason in reasons.items():
        by_reason.setdefault(reason, []).append(module)
    return "; ".join(f"{reason}: {', '.join(modules)}" for reason, modules in by_reason.items())
