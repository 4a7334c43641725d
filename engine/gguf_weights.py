"""A GGUF file's linear weights kept in their stored block formats (kernels/quantized.py), for the CPU.

The model itself loads from the dequantized directory made once from the file (engine/loader.py): that gives
every tensor, in float. Then the projections whose blocks the kernels read (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K,
Q6_K) take their blocks from the GGUF file instead, fused as the model fuses them (q/k/v, gate/up: a block never
spans rows, so fusing is stacking rows), and the float copies are dropped. Other types stay dequantized, and so
does a fused projection whose parts differ in type (a Q4_K_M file stores some v and down projections in Q6_K,
the rest in Q4_K: rows of two formats do not stack), with one log line naming them.

llama.cpp's converter permutes the rows of Llama-architecture q and k weights (its RoPE pairs neighbouring
features, transformers' pairs halves); transformers undoes that when it dequantizes, so the rows are put back
in its order here too.

Reading a GGUF file's metadata (its whole vocabulary) takes seconds in gguf-py, so the fused blocks are saved
once beside the dequantized weights (BLOCKS_FILE) and later starts read them in milliseconds.
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

from pagedserve.engine.models import ModelSpec
from pagedserve.kernels.quantized import FORMATS, QuantizedWeight

logger = logging.getLogger(__name__)

SOURCE_FILE = "pagedserve_source.json"  # written by materialize_gguf beside the dequantized weights
BLOCKS_FILE = "pagedserve_blocks/blocks.safetensors"  # the fused blocks, saved at the first load (a folder of
# its own: the weights loader reads every *.safetensors file at the top)
BLOCKS_FORMAT = "2"  # bump when what is saved changes (2: K-quants; a tied head from token_embd)
PERMUTED_ARCHITECTURES = frozenset({"llama"})  # whose q/k rows llama.cpp's converter permutes
TYPE_NAMES = {fmt.ggml_type: name for name, fmt in FORMATS.items()}
Part = tuple[ReaderTensor, str]  # a GGUF tensor and its role ("attn_q", "ffn_down", "output")
# Our fused projection -> the GGUF tensors stacked into it, in order.
FUSED = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a dequantized model directory was made from, if it was made from one."""
    marker = model_dir / SOURCE_FILE
    if not marker.exists():
        return None
    source = Path(json.loads(marker.read_text())["gguf"])
    return source if source.exists() else None


def stored_blocks(model_dir: Path, gguf_file: Path, spec: ModelSpec) -> dict[str, QuantizedWeight]:
    """read_quantized_weights, from the model directory's saved copy when there is one (saved if not)."""
    saved = model_dir / BLOCKS_FILE
    if saved.exists():
        weights = _load_saved(saved)
        if weights is not None:
            return weights
    weights = read_quantized_weights(gguf_file, spec)
    _save(weights, saved)
    return weights


def save_blocks_once(model_dir: Path) -> None:
    """Saves a converted GGUF's blocks now (an image build, `python -m pagedserve.engine`), so that a later start
    from a read-only directory finds them."""
    source = gguf_source(model_dir)
    if source is not None and not (model_dir / BLOCKS_FILE).exists():
        spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir))
        stored_blocks(model_dir, source, spec)


def _save(weights: dict[str, QuantizedWeight], path: Path) -> None:
    """Best effort: a read-only model directory (an image's, another user's) only costs the next start time."""
    tensors = {name: weight.blocks for name, weight in weights.items()}
    layout = {name: [weight.qtype, *weight.shape] for name, weight in weights.items()}
    metadata = {"format": BLOCKS_FORMAT, "layout": json.dumps(layout)}
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


def _load_saved(path: Path) -> dict[str, QuantizedWeight] | None:
    with safe_open(path, framework="pt") as saved:
        metadata = saved.metadata() or {}
        if metadata.get("format") != BLOCKS_FORMAT:
            return None
        layout = json.loads(metadata["layout"])
        return {
            name: QuantizedWeight(qtype, saved.get_tensor(name), (out_features, in_features))
            for name, (qtype, out_features, in_features) in layout.items()
        }


def read_quantized_weights(gguf_file: Path, spec: ModelSpec) -> dict[str, QuantizedWeight]:
    """Our module names ("layers.3.mlp.gate_up_proj", "lm_head") -> their weights as stored blocks."""
    reader = GGUFReader(gguf_file)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    permuted = _architecture(reader) in PERMUTED_ARCHITECTURES
    weights: dict[str, QuantizedWeight] = {}
    kept_float: dict[str, str] = {}  # module -> its parts' types
    for module, parts in _projections(tensors, spec):
        types = [tensor.tensor_type for tensor, _ in parts]
        if len(set(types)) == 1 and int(types[0]) in TYPE_NAMES:
            weights[module] = _stack([_rows(tensor, part, spec, permuted) for tensor, part in parts])
        else:
            kept_float[module] = "+".join(dict.fromkeys(t.name for t in types))
    if kept_float:
        _log_kept_float(kept_float)
    return weights


def _projections(tensors: dict[str, ReaderTensor], spec: ModelSpec) -> Iterator[tuple[str, list[Part]]]:
    """Each of our projections with the GGUF tensors stacked into it, in order."""
    for layer in range(spec.num_layers):
        for module, parts in FUSED.items():
            yield f"layers.{layer}.{module}", [(tensors[f"blk.{layer}.{part}.weight"], part) for part in parts]
    # A tied model's head is its embedding (transformers loads token_embd into it), whatever else the file holds.
    head = tensors.get("token_embd.weight") if spec.tie_word_embeddings else tensors.get("output.weight")
    if head is not None:
        yield "lm_head", [(head, "output")]


def _log_kept_float(kept_float: dict[str, str]) -> None:
    by_types: dict[str, list[str]] = {}
    for module, types in kept_float.items():
        by_types.setdefault(types, []).append(module)
    named = "; ".join(f"{types}: {', '.join(modules)}" for types, modules in by_types.items())
    logger.info(
        "%d projections stay dequantized (block types without a kernel, or fused parts of different types): %s",
        len(kept_float),
        named,
    )


def _architecture(reader: GGUFReader) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        return ""
    return bytes(field.parts[field.data[0]]).decode()


def _rows(tensor: ReaderTensor, part: str, spec: ModelSpec, permuted: bool) -> QuantizedWeight:
    """The tensor's blocks (a type with a kernel) as a [out, in] weight in transformers' row order."""
    qtype = TYPE_NAMES[int(tensor.tensor_type)]
    out_features, in_features = (int(n) for n in reversed(tensor.shape.tolist()))
    weight = QuantizedWeight.from_gguf(tensor.data, qtype, (out_features, in_features))
    heads = {"attn_q": spec.num_heads, "attn_k": spec.num_kv_heads}.get(part)
    if permuted and heads is not None:
        order = torch.from_numpy(_unpermuted_rows(out_features, heads))
        weight = QuantizedWeight(qtype, weight.blocks[order].contiguous(), weight.shape)
    return weight


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
