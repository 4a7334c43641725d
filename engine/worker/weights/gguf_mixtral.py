"""Mixtral as llama.cpp stores it: a "llama" file whose layers hold experts (ffn_gate_inp and the three
*_exps tensors) and whose metadata counts them (llama.expert_count, llama.expert_used_count).

transformers' GGUF config conversion reads such a file as a dense Llama and drops the expert counts; here the
config becomes Mixtral's, so the MoE model is built and weights/gguf_moe.py reads the experts as stored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedserve.engine.worker.weights.gguf_metadata import file_scalars


def with_llama_experts(gguf_file: Path, values: dict[str, Any]) -> dict[str, Any]:
    """transformers' config values of `gguf_file`: Mixtral's where a "llama" file has experts; else unchanged."""
    if values.get("model_type") != "llama":
        return values
    metadata = file_scalars(gguf_file, "llama")
    experts = int(metadata.get("expert_count", 0))
    if experts == 0:
        return values
    values = dict(values, model_type="mixtral", num_local_experts=experts)
    values["num_experts_per_tok"] = int(metadata["expert_used_count"])
    return values
