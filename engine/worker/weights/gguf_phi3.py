"""What a Phi-3 GGUF file says about its RoPE that transformers' GGUF config leaves out.

llama.cpp's converter writes Phi-3.5 / Phi-4-mini's LongRoPE factors as two tensors (rope_factors_short,
rope_factors_long), its pretraining length as rope.scaling.original_context_length and, for Phi-4-mini, the
rotated dimensions as rope.dimension_count (fewer than a head's). transformers reads none of these, so the
config it builds from the file would rotate as plain RoPE: they are put back into it here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def phi3_rope_config(gguf_file: Path, config: dict[str, Any]) -> dict[str, Any]:
    """`config` (transformers' values for the file) with the file's partial rotary dimensions and LongRoPE."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_file)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotated = _field(reader, "phi3.rope.dimension_count")
    out = dict(config)
    if rotated is not None and int(rotated) < head_dim:
        out["partial_rotary_factor"] = int(rotated) / head_dim
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if "rope_factors_long.weight" in tensors and "rope_factors_short.weight" in tensors:
        original = _field(reader, "phi3.rope.scaling.original_context_length")
        if original is None:
            raise ValueError(f"{gguf_file.name} has LongRoPE factors but no rope.scaling.original_context_length")
        out["original_max_position_embeddings"] = int(original)
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": tensors["rope_factors_short.weight"].data.astype(float).tolist(),
            "long_factor": tensors["rope_factors_long.weight"].data.astype(float).tolist(),
            "original_max_position_embeddings": int(original),
        }  # the attention factor follows from the two lengths, as transformers computes it
    return out


def _field(reader: Any, key: str) -> float | None:
    field = reader.fields.get(key)
    return None if field is None else float(field.parts[field.data[0]][0])
