"""A GGUF file's tensor table: each tensor's name, ggml type, dimensions and where its bytes lie, read without
touching a tensor. Its own module so that the readers of single tensors at load time (gguf_phi3's LongRoPE factors)
and the folder that caches the table (gguf_files) both use it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a GGUF file: its ggml type id, its dimensions innermost first (as GGUF lists them), and
    where its bytes lie in the file."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Outermost first, as torch orders them: (out, in) for a linear layer's weight."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class TensorIndex:
    architecture: str  # general.architecture: "llama", "qwen2", ...
    tensors: dict[str, StoredTensor]


def read_index(gguf_file: Path) -> TensorIndex:
    """The file's tensor table, read without touching a tensor: transformers' header reader takes milliseconds
    where gguf-py's (the fallback, for older transformers) parses every metadata field first."""
    try:
        from transformers.integrations.gguf.reader import GgufHeader

        header = GgufHeader.from_file(str(gguf_file))
    except (ImportError, ValueError):  # older transformers; or a type it does not size (Q5_0, Q5_1, TQ*, ...)
        return _read_index_with_gguf_py(gguf_file)
    tensors = {
        t.name: StoredTensor(t.name, t.ggml_type, tuple(reversed(t.shape)), header.data_start + t.offset, t.nbytes)
        for t in header.tensors
    }
    return TensorIndex(header.architecture, tensors)


def _read_index_with_gguf_py(gguf_file: Path) -> TensorIndex:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_file)  # a memory map: no tensor's bytes are read here
    field = reader.fields.get("general.architecture")
    architecture = "" if field is None else bytes(field.parts[field.data[0]]).decode()
    tensors = {
        t.name: StoredTensor(
            t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes)
        )
        for t in reader.tensors
    }
    return TensorIndex(architecture, tensors)
