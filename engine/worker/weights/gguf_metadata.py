"""A GGUF file's scalar metadata, read without its tensors: the settings transformers' config conversion drops."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def file_scalars(gguf_file: Path, architecture: str) -> dict[str, Any]:
    """The file's scalar metadata under `architecture.`, by the rest of their key."""
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
