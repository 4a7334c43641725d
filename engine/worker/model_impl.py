"""Which implementation runs a checkpoint (`model_impl`).

`auto` runs our own model where the architecture has one (models/spec.py: SUPPORTED_ARCHITECTURES) and
transformers' modules with paged attention (models/transformers_fallback.py, loaded by transformers_loader.py)
for every other decoder. Light on purpose: every start reads this, while transformers' modeling modules (seconds
of imports, and torch's compiler, which wants a writable temporary folder) load only for the fallback.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from pagedserve.engine.config import MODEL_IMPLS, EngineConfig
from pagedserve.engine.worker.models.spec import SUPPORTED_ARCHITECTURES

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
