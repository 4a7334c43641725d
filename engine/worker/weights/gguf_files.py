"""A GGUF file's folder: what serving it needs besides its tensors, read from its metadata once.

A GGUF file holds the config, the tokenizer and the chat template as metadata, and its tensors in place.
Serving reads the tensors straight from the file (weights/gguf.py); what transformers derives from the metadata
(a config, a fast tokenizer: seconds for a large vocabulary) and the file's tensor index (gguf-py parses every
metadata field to list the tensors: seconds again) are kept in a small folder per file, so that later starts
read a few JSON files instead:

    config.json, generation_config.json, tokenizer files   as transformers reads a model directory
    pagedserve_source.json                                 the GGUF file it was made from
    pagedserve_tensors.json                                the file's tensor index (name, type, dims, offset)

`dequantized_model_dir` writes a transformers directory of the file's weights in float32: transformers
loads that as the oracle that tests and benchmarks compare with. Serving never makes one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pagedserve.engine.worker.weights.gguf_config import gguf_config_values
from pagedserve.engine.worker.weights.gguf_gemma import with_gemma_settings
from pagedserve.engine.worker.weights.gguf_index import StoredTensor, TensorIndex, read_index
from pagedserve.engine.worker.weights.gguf_mixtral import with_llama_experts
from pagedserve.engine.worker.weights.gguf_phi3 import phi3_rope_config

logger = logging.getLogger(__name__)

SOURCE_FILE = "pagedserve_source.json"
INDEX_FILE = "pagedserve_tensors.json"
FOLDER_FORMAT = 3  # bumped whenever these folders change, so stale ones are not reused (2: float32 weights)


def cache_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedserve" / "gguf"
    return Path(os.environ.get("PAGEDSERVE_CACHE_DIR", default))


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a model directory was made from, if it was made from one."""
    marker = model_dir / SOURCE_FILE
    if not marker.exists():
        return None
    source = Path(json.loads(marker.read_text())["gguf"])
    return source if source.exists() else None


def gguf_model_dir(gguf_file: Path) -> Path:
    """The folder of `gguf_file`'s config, tokenizer and tensor index, made once (a few MB, no weights)."""
    target = _cached_folder(gguf_file, "")
    if not (target / INDEX_FILE).exists():
        logger.info("reading %s's config, tokenizer and tensor index into %s (once)", gguf_file, target)
        _make_atomically(target, lambda staging: _write_metadata(gguf_file, staging))
    return target


def dequantized_model_dir(gguf_file: Path) -> Path:
    """A transformers directory of `gguf_file`'s weights in float32 (made once), beside its metadata: what
    transformers loads to compare with. pagedserve, given this directory, still serves the GGUF's blocks."""
    target = _cached_folder(gguf_file, "-float32")
    if not (target / "model.safetensors").exists():
        metadata = gguf_model_dir(gguf_file)
        logger.info("dequantizing %s into %s (once)", gguf_file, target)

        def write(staging: Path) -> None:
            shutil.copytree(metadata, staging, dirs_exist_ok=True)
            _write_float_weights(gguf_file, staging)

        _make_atomically(target, write)
    return target


def load_index(model_dir: Path, gguf_file: Path) -> TensorIndex:
    """The tensor index kept in `model_dir`, or read from the file where the folder has none."""
    saved = model_dir / INDEX_FILE
    if saved.exists():
        data = json.loads(saved.read_text())
        if data.get("file_size") == gguf_file.stat().st_size:
            tensors = {t[0]: StoredTensor(t[0], t[1], tuple(t[2]), t[3], t[4]) for t in data["tensors"]}
            return TensorIndex(data["architecture"], tensors)
    return read_index(gguf_file)


def _cached_folder(gguf_file: Path, suffix: str) -> Path:
    stat = gguf_file.stat()
    identity = f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{FOLDER_FORMAT}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_root() / f"{gguf_file.stem}-{key}{suffix}"


def _make_atomically(target: Path, write) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        write(staging)
        os.replace(staging, target)  # atomic: concurrent makers never see half a folder
    except OSError:
        if not target.exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_metadata(gguf_file: Path, folder: Path) -> None:
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = _config(gguf_file)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if architecture is not None:  # GGUF configs lack it; other tools (transformers serve) need it
        config.architectures = [architecture]
    index = read_index(gguf_file)
    _experts_width(config, index)
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    _tokenizer(gguf_file).save_pretrained(folder)
    tensors = [[t.name, t.ggml_type, list(t.dims), t.offset, t.nbytes] for t in index.tensors.values()]
    document = {"architecture": index.architecture, "file_size": gguf_file.stat().st_size, "tensors": tensors}
    (folder / INDEX_FILE).write_text(json.dumps(document))
    (folder / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf_file.resolve())}))


def _experts_width(config: Any, index: TensorIndex) -> None:
    """An MoE file's expert width, read from the experts' shape [experts, width, hidden]: transformers' GGUF
    config leaves a qwen3moe file's at its default (Mixtral's is its feed-forward length, read the same way)."""
    experts = index.tensors.get("blk.0.ffn_gate_exps.weight")
    if experts is None:
        return
    shared = index.tensors.get("blk.0.ffn_gate_shexp.weight")  # Qwen2-MoE's shared expert [width, hidden]
    if shared is not None and hasattr(config, "shared_expert_intermediate_size"):
        config.shared_expert_intermediate_size = shared.shape[0]
    if hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = experts.shape[1]
    elif config.model_type == "mixtral":
        config.intermediate_size = experts.shape[1]


def _config(gguf_file: Path) -> Any:
    """transformers' config of the file, from one parse of its metadata (what AutoConfig does with gguf_file)."""
    from transformers import CONFIG_MAPPING

    values = gguf_config_values(gguf_file)
    if values["model_type"] == "phi3":
        values = phi3_rope_config(gguf_file, values)
    values = with_gemma_settings(gguf_file, values)
    values = with_llama_experts(gguf_file, values)
    return CONFIG_MAPPING[values["model_type"]].from_dict(values)


def _tokenizer(gguf_file: Path) -> Any:
    """transformers' fast tokenizer of the file. Built from its converter directly: AutoTokenizer would parse the
    whole file once more for a config (seconds, tens of seconds for a large vocabulary) only to pick a class."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer
        from transformers.tokenization_utils_fast import PreTrainedTokenizerFast
    except ImportError:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    architecture, tokenizer, tokenizer_config = get_gguf_tokenizer(str(gguf_file))
    converted, extra = convert_gguf_tokenizer(architecture, tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=converted, **tokenizer_config, **extra)


def _write_float_weights(gguf_file: Path, folder: Path) -> None:
    """transformers dequantizes the file (its own loader) and the tensors are saved as they came out."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
