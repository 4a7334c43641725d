"""A GGUF file's transformers config values, read from its metadata in milliseconds.

transformers' `load_gguf_checkpoint` builds them through gguf-py's reader, which makes a numpy view of every element
of every metadata array: a 49,152-token vocabulary and its merges took 13 s of a 1B file's 20 s cold start.
transformers' own header reader (`read_gguf_metadata`) leaves those arrays as their lengths, and for the
architectures below the config is transformers' GGUF key mapping applied to the metadata, under transformers' name
for the architecture, and nothing else. The others (patched inside `load_gguf_checkpoint`: Mistral-named Llama
files, Gemma 4, gpt-oss, LFM2, T5, ...) and older transformers without the reader take `load_gguf_checkpoint` as
before. tests/test_gguf_config.py holds both ways equal for every architecture read here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

# Architectures whose config load_gguf_checkpoint takes from the key mapping alone (and a default or two), by
# transformers' name where it differs (it renames the metadata keys to match), and the model_type of the files that
# hold only a multimodal model's text backbone.
MAPPED_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen2moe", "qwen3moe"})
TRANSFORMERS_NAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
TEXT_MODEL_TYPES = {"gemma3": "gemma3_text"}


def gguf_config_values(gguf_file: Path) -> dict[str, Any]:
    """What `load_gguf_checkpoint(gguf_file)["config"]` gives, without its parse of the tokenizer's arrays where
    the architecture allows."""
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata
        from transformers.modeling_gguf_pytorch_utils import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_TO_TRANSFORMERS_MAPPING
    except ImportError:
        return _values_from_checkpoint(gguf_file)
    metadata, tensor_names = read_gguf_metadata(str(gguf_file))
    architecture = metadata.get("general.architecture")
    if architecture not in MAPPED_ARCHITECTURES or "mistral" in str(metadata.get("general.name", "")).lower():
        return _values_from_checkpoint(gguf_file)
    name = TRANSFORMERS_NAMES.get(architecture, architecture)
    values: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(name, {}).items():
        values.setdefault(key, value)
    renames = cast(dict[str, dict[str, Any]], GGUF_TO_TRANSFORMERS_MAPPING["config"])
    for key, value in metadata.items():
        prefix, _, rest = key.replace(architecture, name).partition(".")
        renamed = renames.get(prefix, {}).get(rest)
        if renamed is not None and renamed != -1:
            values[renamed] = value.replace(architecture, name) if isinstance(value, str) else value
    values["model_type"] = TEXT_MODEL_TYPES.get(values["model_type"], values["model_type"])
    tokens = metadata.get("tokenizer.ggml.tokens")  # the reader's count of the vocabulary's strings
    if "vocab_size" not in values and isinstance(tokens, int):
        values["vocab_size"] = tokens
    return values


def _values_from_checkpoint(gguf_file: Path) -> dict[str, Any]:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    return load_gguf_checkpoint(str(gguf_file), return_tensors=False)["config"]
