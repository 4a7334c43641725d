"""Loading the transformers fallback: transformers' own model with pagedserve's paged attention
(models/transformers_fallback.py). Imported only where model_impl.py chose it."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.text.hf_tokenizer import eos_token_ids, load_tokenizer
from pagedserve.engine.worker.loaded_model import LoadedModel
from pagedserve.engine.worker.model_impl import architecture_name
from pagedserve.engine.worker.models.transformers_attention import ATTENTION_NAME, register_paged_attention
from pagedserve.engine.worker.models.transformers_fallback import TransformersForCausalLM
from pagedserve.engine.worker.weights.gguf_files import dequantized_model_dir, gguf_source
from pagedserve.kernels import get_backend
from pagedserve.kernels.quantized import FORMATS

logger = logging.getLogger(__name__)


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
