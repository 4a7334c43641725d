"""Gemma settings of a GGUF file that transformers' conversion of its config leaves at their defaults.

llama.cpp's converter writes the soft-caps and Gemma 3's RoPE scaling (linear, factor 8 for 4B and larger) under
keys transformers does not map, and keeps no query scale: llama.cpp derives it, hidden / heads for the 27B models
(the only ones whose query_pre_attn_scalar is not head_dim) and head_dim for the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedserve.engine.worker.weights.gguf_metadata import file_scalars

GEMMA_MODEL_TYPES = {"gemma2": "gemma2", "gemma3_text": "gemma3"}  # transformers' model_type -> GGUF architecture
LAYERS_OF_27B = {"gemma2": 46, "gemma3": 62}  # how llama.cpp tells the 27B models apart


def with_gemma_settings(gguf_file: Path, values: dict[str, Any]) -> dict[str, Any]:
    """transformers' config values of `gguf_file`, with the Gemma settings it missed; others unchanged."""
    architecture = GEMMA_MODEL_TYPES.get(values.get("model_type", ""))
    if architecture is None:
        return values
    metadata = file_scalars(gguf_file, architecture)
    values = dict(values)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cap in metadata:
            values[cap] = float(metadata[cap])
    if values.get("num_hidden_layers") == LAYERS_OF_27B[architecture]:
        values["query_pre_attn_scalar"] = values["hidden_size"] // values["num_attention_heads"]
    elif "head_dim" in values:
        values["query_pre_attn_scalar"] = values["head_dim"]
    if architecture == "gemma3" and metadata.get("rope.scaling.type") == "linear":
        values["rope_scaling"] = {"rope_type": "linear", "factor": float(metadata["rope.scaling.factor"])}
    return values
