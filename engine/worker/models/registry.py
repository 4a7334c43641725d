"""Which model class serves a checkpoint, and the RoPE tables it takes (built before a model on the meta device)."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.engine.worker.distributed.group import TensorParallelGroup
from pagedserve.engine.worker.models.gemma import GemmaForCausalLM
from pagedserve.engine.worker.models.gemma_settings import GEMMA_ARCHITECTURES, GemmaRotary
from pagedserve.engine.worker.models.layers import RotaryEmbedding
from pagedserve.engine.worker.models.llama import LlamaForCausalLM, rotary_embedding
from pagedserve.engine.worker.models.moe import MoeForCausalLM
from pagedserve.engine.worker.models.moe_spec import MOE_ARCHITECTURES
from pagedserve.engine.worker.models.phi3 import Phi3ForCausalLM
from pagedserve.engine.worker.models.spec import ModelSpec
from pagedserve.kernels import KernelBackend

# The class of each architecture whose layers differ from Llama's in more than the spec says (Gemma's take
# rotary tables of their own, below).
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "Phi3ForCausalLM": Phi3ForCausalLM,
    **dict.fromkeys(MOE_ARCHITECTURES, MoeForCausalLM),
}


def rotary_tables(spec: ModelSpec, hf_config: Any, max_positions: int) -> nn.Module:
    """The model's cos/sin tables, on the default device."""
    if spec.architecture in GEMMA_ARCHITECTURES:
        return GemmaRotary(spec.head_dim, max_positions, hf_config)
    return rotary_embedding(spec, hf_config, max_positions)


def build_model(
    spec: ModelSpec,
    hf_config: Any,
    backend: KernelBackend,
    max_positions: int,
    group: TensorParallelGroup | None = None,
    rotary: nn.Module | None = None,
) -> LlamaForCausalLM:
    """The model class for `spec`'s architecture, built with LlamaForCausalLM's arguments."""
    if spec.architecture in GEMMA_ARCHITECTURES:
        assert rotary is None or isinstance(rotary, GemmaRotary)
        return GemmaForCausalLM(spec, hf_config, backend, max_positions, group, rotary)
    assert rotary is None or isinstance(rotary, RotaryEmbedding)
    model_class = MODEL_CLASSES.get(spec.architecture, LlamaForCausalLM)
    return model_class(spec, hf_config, backend, max_positions, group, rotary)
