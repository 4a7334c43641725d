"""A GGUF file's linear weights kept in their stored block formats (kernels/quantized.py), for the CPU.

The model itself loads from the dequantized directory made once from the file (weights/checkpoint.py): that
gives every tensor, in float. Then the projections whose blocks the kernels read (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K,
Q6_K) take their blocks from the GGUF file instead, fused as the model fuses them (q/k/v, gate/up: a block never
spans rows, so fusing is stacking rows), and the float copies are dropped. Other types stay dequantized, and so
does a fused projection whose parts differ in type (a Q4_K_M file stores some v and down projections in Q6_K,
the rest in Q4_K: rows of two formats do not stack), with one log line naming them.

llama.cpp's converter permutes the rows of Llama-architecture q and k weights (its RoPE pairs neighbouring
features, transformers' pairs halves); transformers undoes that when it dequantizes, so the rows are put back
in its order here too.

Split over tensor-parallel ranks, each rank reads only its shard of each tensor from the memory-mapped file
(weights/block_shards.py), sliced as the float weights are (LlamaForCausalLM.checkpoint_slice). A row-parallel
projection whose rank slice does not fall on its format's blocks stays dequantized, with one log line.

Reading a GGUF file's metadata (its whole vocabulary) takes seconds in gguf-py, so the fused blocks are saved
once beside the dequantized weights (BLOCKS_FILE; a rank's shard in a file of its own, blocks_file) and later
starts read them in milliseconds.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from pagedserve.engine.worker.models import ModelSpec
from pagedserve.engine.worker.models.layers import vocab_rows_per_rank
from pagedserve.engine.worker.models.llama import rank_slice
from pagedserve.engine.worker.weights.block_shards import CheckpointSlice, on_block_boundaries, read_shard
from pagedserve.kernels.quantized import FORMATS, QuantizedWeight

logger = logging.getLogger(__name__)

SOURCE_FILE = "pagedserve_source.json"  # written by materialize_gguf beside the dequantized weights
BLOCKS_FILE = "pagedserve_blocks/blocks.safetensors"  # the fused blocks, saved at the first load (a folder of
# its own: the weights loader reads every *.safetensors file at the top)
BLOCKS_FORMAT = "2"  # bump when what is saved changes (2: K-quants; a tied head from token_embd)
PERMUTED_ARCHITECTURES = frozenset({"llama"})  # whose q/k rows llama.cpp's converter permutes
TYPE_NAMES = {fmt.ggml_type: name for name, fmt in FORMATS.items()}
Part = tuple[ReaderTensor, str]  # a GGUF tensor and its role ("attn_q", "ffn_down", "output")
Split = tuple[int, int]  # (rank, size): a tensor-parallel rank's shard; None for the whole model
# Our fused projection -> the GGUF tensors stacked into it, in order.
FUSED = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
PART_MODULES = {  # a GGUF role -> the transformers module it dequantizes into
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a dequantized model directory was made from, if it was made from one."""
    marker = model_dir / SOURCE_FILE
    if not marker.exists():
        return None
    source = Path(json.loads(marker.read_text())["gguf"])
    return source if source.exists() else None


def blocks_file(split: Split | None) -> str:
    """Where a model directory keeps the saved blocks of the whole model, or of one rank's shard."""
    return BLOCKS_FILE if split is None else f"pagedserve_blocks/blocks-rank{split[0]}-of-{split[1]}.safetensors"


def stored_blocks(
    model_dir: Path, gguf_file: Path, spec: ModelSpec, split: Split | None = None
) -> dict[str, QuantizedWeight]:
    """read_quantized_weights, from the model directory's saved copy when there is one (saved if not)."""
    saved = model_dir / blocks_file(split)
    if saved.exists():
        loaded = _load_saved(saved)
        if loaded is not None:
            _log(loaded[1])
            return loaded[0]
    weights, notes = _read(gguf_file, spec, split)
    _log(notes)
    _save(weights, notes, saved)
    return weights


def save_blocks_once(model_dir: Path) -> None:
    """Saves a converted GGUF's blocks now (an image build, `python -m pagedserve.engine`), so that a later start
    from a read-only directory finds them."""
    source = gguf_source(model_dir)
    if source is not None and not (model_dir / BLOCKS_FILE).exists():
        spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir))
        stored_blocks(model_dir, source, spec)


def _save(weights: dict[str, QuantizedWeight], notes: list[str], path: Path) -> None:
    """Best effort: a read-only model directory (an image's, another user's) only costs the next start time.
    `notes`, the log lines on what stays dequantized, are kept to be logged again at each start."""
    tensors = {name: weight.blocks for name, weight in weights.items()}
    layout = {name: [weight.qtype, *weight.shape] for name, weight in weights.items()}
    metadata = {"format": BLOCKS_FORMAT, "layout": json.dumps(layout), "notes": json.dumps(notes)}
    staging = None
    try:
        path.parent.mkdir(exist_ok=True)
        descriptor, staging = tempfile.mkstemp(dir=path.parent, prefix=".blocks-")
        os.close(descriptor)
        save_file(tensors, staging, metadata=metadata)
        os.replace(staging, path)  # atomic: a concurrent loader never reads half a file
    except OSError as exc:
        logger.warning("could not save the stored blocks to %s (%s); the next start reads the GGUF again", path, exc)
    finally:
        if staging is not None:
            Path(staging).unlink(missing_ok=True)


def _load_saved(path: Path) -> tuple[dict[str, QuantizedWeight], list[str]] | None:
    with safe_open(path, framework="pt") as saved:
        metadata = saved.metadata() or {}
        if metadata.get("format") != BLOCKS_FORMAT:
            return None
        layout = json.loads(metadata["layout"])
        weights = {
            name: QuantizedWeight(qtype, saved.get_tensor(name), (out_features, in_features))
            for name, (qtype, out_features, in_features) in layout.items()
        }
        return weights, json.loads(metadata.get("notes", "[]"))  # files saved before notes were kept have none


def read_quantized_weights(gguf_file: Path, spec: ModelSpec, split: Split | None = None) -> dict[str, QuantizedWeight]:
    """Our module names ("layers.3.mlp.gate_up_proj", "lm_head") -> their weights as stored blocks: this rank's
    shards of them where `split` names a rank."""
    weights, notes = _read(gguf_file, spec, split)
    _log(notes)
    return weights


def _read(gguf_file: Path, spec: ModelSpec, split: Split | None) -> tuple[dict[str, QuantizedWeight], list[str]]:
    """(the weights, log lines naming the projections that stay dequantized and why)."""
    reader = GGUFReader(gguf_file)  # a memory map: tensors are read only where sliced below
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    permuted = _architecture(reader) in PERMUTED_ARCHITECTURES
    weights: dict[str, QuantizedWeight] = {}
    kept_float: dict[str, str] = {}  # module -> its parts' types
    off_blocks: dict[str, str] = {}  # module -> its type, where a rank's input columns split its blocks
    for module, parts in _projections(tensors, spec):
        types = [tensor.tensor_type for tensor, _ in parts]
        if len(set(types)) != 1 or int(types[0]) not in TYPE_NAMES:
            kept_float[module] = "+".join(dict.fromkeys(t.name for t in types))
            continue
        slices = [_part_slice(tensor, part, spec, split) for tensor, part in parts]
        if not all(on_block_boundaries(s, TYPE_NAMES[int(types[0])]) for s in slices):
            off_blocks[module] = types[0].name
            continue
        shards = [
            _rows(tensor, part, spec, permuted, s, split) for (tensor, part), s in zip(parts, slices, strict=True)
        ]
        weights[module] = _stack(shards)
    return weights, _kept_float_notes(kept_float) + _off_blocks_notes(off_blocks, spec, split)


def _projections(tensors: dict[str, ReaderTensor], spec: ModelSpec) -> Iterator[tuple[str, list[Part]]]:
    """Each of our projections with the GGUF tensors stacked into it, in order."""
    for layer in range(spec.num_layers):
        for module, parts in FUSED.items():
            yield f"layers.{layer}.{module}", [(tensors[f"blk.{layer}.{part}.weight"], part) for part in parts]
    # A tied model's head is its embedding (transformers loads token_embd into it), whatever else the file holds.
    head = tensors.get("token_embd.weight") if spec.tie_word_embeddings else tensors.get("output.weight")
    if head is not None:
        yield "lm_head", [(head, "output")]


def _part_slice(tensor: ReaderTensor, part: str, spec: ModelSpec, split: Split | None) -> CheckpointSlice | None:
    """The rank's slice of a GGUF tensor: the one its float twin's checkpoint tensor is read with."""
    if split is None:
        return None
    if part == "output":
        return rank_slice("lm_head.weight", spec, *split)
    layer = tensor.name.split(".")[1]  # "blk.3.attn_q.weight"
    return rank_slice(f"model.layers.{layer}.{PART_MODULES[part]}.weight", spec, *split)


def _kept_float_notes(kept_float: dict[str, str]) -> list[str]:
    if not kept_float:
        return []
    return [
        f"{len(kept_float)} projections stay dequantized (block types without a kernel, or fused parts of "
        f"different types): {_grouped(kept_float)}"
    ]


def _off_blocks_notes(off_blocks: dict[str, str], spec: ModelSpec, split: Split | None) -> list[str]:
    if not off_blocks or split is None:
        return []
    rank, size = split
    widths = f"attention {spec.num_heads * spec.head_dim // size}, MLP {spec.intermediate_size // size}"
    return [
        f"{len(off_blocks)} row-parallel projections stay dequantized on rank {rank} of {size}: a rank's input "
        f"columns ({widths}) do not fall on their format's blocks (32 weights, 256 for K-quants): "
        f"{_grouped(off_blocks)}"
    ]


def _grouped(reasons: dict[str, str]) -> str:
    """Modules by reason: 'Q4_K+Q6_K: layers.0.self_attn.qkv_proj, ...; Q5_0: ...'."""
    by_reason: dict[str, list[str]] = {}
    for module, reason in reasons.items():
        by_reason.setdefault(reason, []).append(module)
    return "; ".join(f"{reason}: {', '.join(modules)}" for reason, modules in by_reason.items())


def _log(notes: list[str]) -> None:
    for note in notes:
        logger.info("%s", note)


def _architecture(reader: GGUFReader) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        return ""
    return bytes(field.parts[field.data[0]]).decode()


def _rows(
    tensor: ReaderTensor,
    part: str,
    spec: ModelSpec,
    permuted: bool,
    part_slice: CheckpointSlice | None,
    split: Split | None,
) -> QuantizedWeight:
    """The tensor's blocks (a type with a kernel) as a [out, in] weight in transformers' row order, or the
    rank's shard `part_slice` of it (the head's padded to the rank's share of the vocabulary)."""
    qtype = TYPE_NAMES[int(tensor.tensor_type)]
    out_features, in_features = (int(n) for n in reversed(tensor.shape.tolist()))
    heads = {"attn_q": spec.num_heads, "attn_k": spec.num_kv_heads}.get(part)
    order = _unpermuted_rows(out_features, heads) if permuted and heads is not None else None
    num_rows = vocab_rows_per_rank(spec.vocab_size, split[1]) if part == "output" and split is not None else None
    return read_shard(tensor.data, qtype, (out_features, in_features), part_slice, order, num_rows)


def _unpermuted_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute_weights on row ids)."""
    half = num_rows // num_heads // 2
    rows = np.arange(num_rows).reshape(num_heads, half, 2)
    return rows.swapaxes(2, 1).reshape(num_rows)


def _stack(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight of the parts' rows (of one type), in order."""
    if len({w.shape[1] for w in weights}) != 1:
        raise ValueError(f"fused parts of different input sizes: {[w.shape for w in weights]}")
    if len(weights) == 1:
        return weights[0]
    blocks = torch.cat([w.blocks for w in weights])
    return QuantizedWeight(weights[0].qtype, blocks, (blocks.shape[0], weights[0].shape[1]))
