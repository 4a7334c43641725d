"""A GGUF file's scalar metadata, read without its tensors: the settings transformers' config conversion drops."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def file_scalars(gguf_file: Path, architecture: str) -> dict[str, Any]:
    """The file's scalar metadata under `architecture.`, by the rest of their key.

    transformers' header reader takes milliseconds; gguf-py's (for older transformers) makes a numpy view of every
    element of the tokenizer's arrays first, seconds for a large vocabulary."""
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata
    except ImportError:
        return _scalars_with_gguf_py(gguf_file, architecture)
    metadata, _ = read_gguf_metadata(str(gguf_file))  # string arrays as their lengths: none is a setting
    prefix = f"{architecture}."
    return {
        key.removeprefix(prefix): value
        for key, value in metadata.items()
        if key.startswith(prefix) and not isinstance(value, list)  # another architecture's, or an array
    }


def _scalars_with_gguf_py(gguf_file: Path, architecture: str) -> dict[str, Any]:
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(gguf_file)  # a memory map: no tensor's bytes are read here
    prefix = f"{architecture}."
    scalars: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not key.startswith(prefix) or len(field.types) != 1:
            continue  # another architecture's, or an array
        value = field.parts[field.data[0]]
        is_text = field.types[0] == GGUFValueType.STRING
        scalars[key.removeprefix(prefix)] = bytes(value).decode() if is_text else value[0].item()
    return scalars
