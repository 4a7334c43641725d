"""What a Phi-3 GGUF file says about its RoPE that transformers' GGUF config leaves out.

llama.cpp's converter writes Phi-3.5 / Phi-4-mini's LongRoPE factors as two tensors (rope_factors_short,
rope_factors_long), its pretraining length as rope.scaling.original_context_length and, for Phi-4-mini, the
rotated dimensions as rope.dimension_count (fewer than a head's). transformers reads none of these, so the
config it builds from the file would rotate as plain RoPE: they are put back into it here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pagedserve.engine.worker.weights.gguf_index import read_index
from pagedserve.engine.worker.weights.gguf_metadata import file_scalars

FACTOR_DTYPES = {0: np.float32, 1: np.float16}  # ggml's F32, F16: how converters store the factors


def phi3_rope_config(gguf_file: Path, config: dict[str, Any]) -> dict[str, Any]:
    """`config` (transformers' values for the file) with the file's partial rotary dimensions and LongRoPE."""
    metadata = file_scalars(gguf_file, "phi3")
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotated = metadata.get("rope.dimension_count")
    out = dict(config)
    if rotated is not None and int(rotated) < head_dim:
        out["partial_rotary_factor"] = int(rotated) / head_dim
    factors = _rope_factors(gguf_file)
    if factors:
        original = metadata.get("rope.scaling.original_context_length")
        if original is None:
            raise ValueError(f"{gguf_file.name} has LongRoPE factors but no rope.scaling.original_context_length")
        out["original_max_position_embeddings"] = int(original)
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": factors["short"],
            "long_factor": factors["long"],
            "original_max_position_embeddings": int(original),
        }  # the attention factor follows from the two lengths, as transformers computes it
    return out


def _rope_factors(gguf_file: Path) -> dict[str, list[float]]:
    """The file's LongRoPE factors by kind ("short", "long"), read from their offsets; empty if it has none."""
    tensors = read_index(gguf_file).tensors
    names = {kind: f"rope_factors_{kind}.weight" for kind in ("short", "long")}
    if any(name not in tensors for name in names.values()):
        return {}
    factors = {}
    for kind, name in names.items():
        tensor = tensors[name]
        dtype = FACTOR_DTYPES.get(tensor.ggml_type)
        if dtype is None:
            raise ValueError(f"{gguf_file.name}: rope_factors_{kind} in ggml type {tensor.ggml_type}, not F32 or F16")
        values = np.fromfile(
            gguf_file, dtype=dtype, count=tensor.nbytes // np.dtype(dtype).itemsize, offset=tensor.offset
        )
        factors[kind] = values.astype(float).tolist()
    return factors
