"""Builds the model and its tokenizer from an EngineConfig (the KV cache is sized in kv_sizing)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.text.hf_tokenizer import eos_token_ids, load_tokenizer
from pagedserve.engine.worker.distributed.group import TensorParallelGroup
from pagedserve.engine.worker.kv_sizing import model_len_limit
from pagedserve.engine.worker.loaded_model import LoadedModel
from pagedserve.engine.worker.model_impl import choose_model_impl
from pagedserve.engine.worker.models import LlamaForCausalLM, ModelSpec
from pagedserve.engine.worker.models.layers import Linear
from pagedserve.engine.worker.models.registry import build_model, rotary_tables
from pagedserve.engine.worker.weights.checkpoint import iter_safetensors, resolve_model_dir
from pagedserve.engine.worker.weights.gguf import GGUFTensors, load_gguf_weights
from pagedserve.engine.worker.weights.gguf_files import gguf_source, load_index
from pagedserve.engine.worker.weights.moe_quantization import quantize_experts_on_load
from pagedserve.engine.worker.weights.on_load_quantization import quantized_on_load
from pagedserve.kernels import KernelBackend, get_backend
from pagedserve.kernels.device_blocks import AnyQuantizedWeight
from pagedserve.kernels.quantized import FORMATS, QuantizedWeight

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# Devices on which `quantization: auto` keeps a GGUF file's blocks. On CUDA the Triton kernel
# (kernels/triton_quantized_linear.py) is opt-in, `quantization: gguf`, until a GPU has run its tests and
# benchmark (tests/test_kernels_triton_quantized.py, benchmarks/triton_quantized_linear.py).
GGUF_BLOCKS_BY_DEFAULT = ("cpu",)


def _quantize_projections(
    config: EngineConfig, model: LlamaForCausalLM, checkpoint: Path | None, device: torch.device, dtype: torch.dtype
) -> None:
    """Every projection quantized to the format `quantization` names, where the backend multiplies block formats
    on this device in this dtype: from the float `checkpoint`'s tensors, or from the model's own (None). Split
    over ranks, each rank keeps its shards."""
    if config.quantization not in FORMATS:
        return
    formats = _formats_multiplied_here(config, model.backend, device, dtype)
    if not formats:
        return
    weights = quantized_on_load(model, config.quantization, checkpoint)
    placed = _placed(model.backend, weights, formats, device)
    model.use_quantized(placed)
    experts = quantize_experts_on_load(
        model, config.quantization, formats, lambda weight: model.backend.place_quantized(weight, device)
    )
    release_freed_memory()  # the float copies just dropped
    stored = sum(weight.nbytes for weight in placed.values()) + experts
    logger.info("%d projections multiply in block formats on %s (%.0f MiB)", len(placed), device, stored / 2**20)


def _gguf_model(
    config: EngineConfig,
    spec: ModelSpec,
    hf_config: Any,
    backend: KernelBackend,
    group: TensorParallelGroup | None,
    sources: tuple[Path, Path],
    device: torch.device,
    dtype: torch.dtype,
) -> LlamaForCausalLM:
    """The model with the GGUF file's tensors read straight into it (weights/gguf.py): built on the meta device,
    so no float copy of it exists; blocks where the backend multiplies them here, float elsewhere.
    `sources`: (the model directory, the GGUF file)."""
    model_dir, gguf_file = sources
    max_positions = model_len_limit(spec)
    with torch.device(device):
        rotary = rotary_tables(spec, hf_config, max_positions).to(dtype=dtype)
    # Real tables, computed first: on the meta device torch computes through its Python reference ops, which
    # import its compiler and need a writable temporary folder (a read-only container has none).
    with torch.device("meta"):
        model = build_model(spec, hf_config, backend, max_positions=max_positions, group=group, rotary=rotary)
    keeps_blocks = config.quantization in ("auto", "gguf")
    formats = _formats_multiplied_here(config, backend, device, dtype) if keeps_blocks else frozenset()
    split = None if group is None else (group.rank, group.size)
    tensors = GGUFTensors(gguf_file, load_index(model_dir, gguf_file), spec, split, model.checkpoint_slice)
    load_gguf_weights(model, tensors, formats, lambda weight: backend.place_quantized(weight, device), device, dtype)
    release_freed_memory()  # the parts of fused projections, copied once more when they were stacked
    stored = sum(m.quantized.nbytes for m in model.modules() if isinstance(m, Linear) and m.quantized is not None)
    logger.info("%s: %.0f MiB of projections in block formats on %s", gguf_file.name, stored / 2**20, device)
    return model.eval()


def _formats_multiplied_here(
    config: EngineConfig, backend: KernelBackend, device: torch.device, dtype: torch.dtype
) -> frozenset[str]:
    """The block formats projections keep on `device` in `dtype`: none where the backend has no kernel for them,
    or where `auto` leaves a GGUF's weights float (GGUF_BLOCKS_BY_DEFAULT)."""
    formats = backend.quantized_formats(device, dtype)
    if not formats:
        logger.info("projections stay float: %s multiplies no block format on %s in %s", backend.name, device, dtype)
        return frozenset()
    if config.quantization == "auto" and device.type not in GGUF_BLOCKS_BY_DEFAULT:
        logger.info("projections stay float on %s: quantization 'gguf' keeps the GGUF file's blocks", device)
        return frozenset()
    return formats


def _placed(
    backend: KernelBackend, weights: dict[str, QuantizedWeight], formats: frozenset[str], device: torch.device
) -> dict[str, AnyQuantizedWeight]:
    """The weights in `formats`, as the backend reads them on `device`; the others stay float."""
    kept = {name: weight for name, weight in weights.items() if weight.qtype in formats}
    if len(kept) < len(weights):
        left = sorted({weight.qtype for weight in weights.values()} - formats)
        logger.info("%d projections stay float: %s has no kernel for %s", len(weights) - len(kept), backend.name, left)
    return {name: backend.place_quantized(weight, device) for name, weight in kept.items()}


def release_freed_memory() -> None:
    """Hands the heap's free pages back to the system (glibc's malloc_trim), where the C library has it.

    The float copies of quantized projections are freed after loading, but glibc keeps freed chunks of the
    sizes it has seen recently on its heap rather than unmapping them: without this the process would keep
    ~200 MiB it no longer uses (measured on SmolLM2).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return  # another C library: nothing to do, or nothing we can do
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


Weights = Iterator[tuple[str, torch.Tensor]]


def _checking(weights: Weights, healthy: Callable[[], None]) -> Weights:
    for item in weights:
        healthy()
        yield item


def load_model(
    config: EngineConfig, group: TensorParallelGroup | None = None, healthy: Callable[[], None] | None = None
) -> LoadedModel:
    """The model (this rank's part of it when split over `group`: only those slices are read). `healthy` runs
    between tensors and raises to stop a load that can no longer be used (another rank died)."""
    device = resolve_device(config.device) if group is None else group.device
    dtype = resolve_dtype(config.dtype, device)
    model_dir = resolve_model_dir(config.model, config.revision)
    hf_config = AutoConfig.from_pretrained(model_dir)
    if choose_model_impl(config.model_impl, hf_config) == "transformers":
        if group is not None:
            raise ValueError("the transformers fallback runs on one rank: tensor_parallel_size must be 1")
        from pagedserve.engine.worker.transformers_loader import load_transformers_model  # only now: see model_impl

        return load_transformers_model(config, model_dir, hf_config, device, dtype)
    spec = ModelSpec.from_hf_config(hf_config)
    if group is not None:
        spec.check_tensor_parallel(group.size)
    tokenizer = load_tokenizer(config.tokenizer or model_dir)
    backend = get_backend(config.attention_backend, device)
    backend.check_supported(dtype, spec.head_dim, config.block_size)
    source = gguf_source(model_dir) if config.load_format == "auto" else None
    if config.quantization == "gguf" and source is None:
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's blocks, but {model_dir} was not made from one")
    if source is not None:
        model = _gguf_model(config, spec, hf_config, backend, group, (model_dir, source), device, dtype)
        _quantize_projections(config, model, None, device, dtype)
    else:
        with torch.device(device), _default_dtype(dtype):
            model = build_model(spec, hf_config, backend, max_positions=model_len_limit(spec), group=group)
        if config.load_format == "auto":
            weights = iter_safetensors(model_dir, None if group is None else model.checkpoint_slice)
            model.load_weights(weights if healthy is None else _checking(weights, healthy))
        model.to(device=device, dtype=dtype).eval()
        _quantize_projections(config, model, model_dir if config.load_format == "auto" else None, device, dtype)
    split = "" if group is None else f" (rank {group.rank} of {group.size})"
    logger.info("loaded %s (%s) on %s in %s%s", model_dir, spec.architecture, device, dtype, split)
    return LoadedModel(
        model_dir=model_dir,
        hf_config=hf_config,
        spec=spec,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(model_dir, hf_config, tokenizer),
        backend=backend,
        device=device,
        dtype=dtype,
        group=group,
    )
