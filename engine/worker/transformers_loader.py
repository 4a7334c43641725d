"""Which implementation runs a checkpoint (`model_impl`), and loading the transformers fallback.

`auto` runs our own model where the architecture has one (models/spec.py: SUPPORTED_ARCHITECTURES) and
transformers' modules with paged attention (models/transformers_fallback.py) for every other decoder.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from pagedserve.engine.config import MODEL_IMPLS, EngineConfig
from pagedserve.engine.text.tokenizer import eos_token_ids, load_tokenizer
from pagedserve.engine.worker.loaded_model import LoadedModel
from pagedserve.engine.worker.models.spec import SUPPORTED_ARCHITECTURES
from pagedserve.engine.worker.models.transformers_attention import ATTENTION_NAME, register_paged_attention
from pagedserve.engine.worker.models.transformers_fallback import TransformersForCausalLM
from pagedserve.engine.worker.weights.gguf_files import dequantized_model_dir, gguf_source
from pagedserve.kernels import get_backend
from pagedserve.kernels.quantized import FORMATS

logger = logging.getLogger(__name__)


def native_architecture(hf_config: Any) -> str | None:
    """The architecture our own model implements for this config, or None. Configs converted from GGUF name only
    a model_type."""
    by_type = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
    architectures = getattr(hf_config, "architectures", None) or [by_type.get(hf_config.model_type, "")]
    return next((arch for arch in architectures if arch in SUPPORTED_ARCHITECTURES), None)


def architecture_name(hf_config: Any) -> str:
    """The causal LM class transformers builds for this config (what the config names where it cannot)."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
    architectures = getattr(hf_config, "architectures", None) or []
    return name or (architectures[0] if architectures else hf_config.model_type)


def resolve_model_impl(setting: str, hf_config: Any) -> str:
    """ "native" or "transformers" for `setting` (auto | native | transformers)."""
    native = native_architecture(hf_config)
    if setting == "native" and native is None:
        raise ValueError(
            f"model_impl 'native': no native implementation of {architecture_name(hf_config)}; native ones: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_impl 'auto' or 'transformers' runs it through transformers)"
        )
    if setting not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {setting!r}")
    return "native" if native is not None and setting != "transformers" else "transformers"


def choose_model_impl(setting: str, hf_config: Any) -> str:
    """resolve_model_impl's answer, said in one log line."""
    chosen = resolve_model_impl(setting, hf_config)
    if chosen == "native":
        logger.info("model implementation: native %s", native_architecture(hf_config))
    else:
        logger.info("model implementation: transformers fallback for %s", architecture_name(hf_config))
    return chosen


def check_fallback_splits(config: EngineConfig, hf_config: Any) -> None:
    """Raises where the fallback would be split over ranks: it runs whole on one."""
    if config.tensor_parallel_size > 1 and resolve_model_impl(config.model_impl, hf_config) == "transformers":
        raise ValueError(
            f"the transformers fallback ({architecture_name(hf_config)}) runs on one rank: tensor_parallel_size "
            "must be 1"
        )


def load_transformers_model(
    config: EngineConfig, model_dir: Path, hf_config: Any, device: torch.device, dtype: torch.dtype
) -> LoadedModel:
    """The fallback model, whole, on `device` in `dtype`, with its tokenizer."""
    if config.quantization == "gguf" or config.quantization in FORMATS:
        raise ValueError(
            f"quantization {config.quantization!r}: the transformers fallback multiplies float weights only "
            "(use 'auto' or 'none'; a GGUF file's weights are dequantized)"
        )
    tokenizer = load_tokenizer(config.tokenizer or model_dir)
    eos = eos_token_ids(model_dir, hf_config, tokenizer)
    backend = get_backend(config.attention_backend, device)
    hf_model = _hf_model(config, model_dir, hf_config, device, dtype)
    model = TransformersForCausalLM(hf_model, backend, tuple(sorted(eos)))
    backend.check_supported(dtype, model.spec.head_dim, config.block_size)
    logger.info("loaded %s (%s, transformers fallback) on %s in %s", model_dir, model.spec.architecture, device, dtype)
    return LoadedModel(
        model_dir=model_dir,
        hf_config=hf_config,
        spec=model.spec,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos,
        backend=backend,
        device=device,
        dtype=dtype,
    )


def _hf_model(
    config: EngineConfig, model_dir: Path, hf_config: Any, device: torch.device, dtype: torch.dtype
) -> PreTrainedModel:
    """transformers' model with paged attention: random weights (load_format dummy), or the checkpoint's (a GGUF
    file's dequantized once, as weights/gguf_files.py keeps them)."""
    register_paged_attention()
    hf_config = copy.deepcopy(hf_config)
    try:
        if config.load_format == "dummy":
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=ATTENTION_NAME)
        else:
            source = gguf_source(model_dir)
            weights_dir = model_dir if source is None else dequantized_model_dir(source)
            model = AutoModelForCausalLM.from_pretrained(
                weights_dir, config=hf_config, dtype=dtype, attn_implementation=ATTENTION_NAME, device_map=str(device)
            )
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise ValueError(f"transformers has no causal LM for model type {hf_config.model_type!r}") from exc
        raise
    except KeyError as exc:  # a model that picks its attention class by name knows only transformers' own
        raise ValueError(
            f"{architecture_name(hf_config)} does not take attention implementations by name (transformers' "
            "attention interface), so the fallback cannot give it paged attention"
        ) from exc
    return model.to(device=device, dtype=dtype).eval()
