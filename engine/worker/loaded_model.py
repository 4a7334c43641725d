"""LoadedModel: a model ready to run, with what the engine needs to know of it (tokenizer, device, dtype, ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from pagedserve.engine.worker.distributed.group import TensorParallelGroup
from pagedserve.engine.worker.models import ModelSpec
from pagedserve.engine.worker.models.causal_lm import CausalLM
from pagedserve.kernels import KernelBackend
from pagedserve.kernels.quantized import QuantizedWeight
from pagedserve.kernels.stacked_weight import RowStackedWeight


@dataclass
class LoadedModel:
    model_dir: Path
    hf_config: Any
    spec: ModelSpec
    model: CausalLM  # LlamaForCausalLM, or TransformersForCausalLM (model_impl)
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    backend: KernelBackend
    device: torch.device
    dtype: torch.dtype
    group: TensorParallelGroup | None = None  # the ranks the model is split over; None: all of it is here

    @property
    def multiplies_blocks_on_cpu(self) -> bool:
        """Whether block-format weights run on the CPU: a product's arithmetic then bounds it from a few rows on,
        so each row more costs about half a one-row product (benchmarks/README.md, integer activations)."""
        if self.device.type != "cpu":
            return False
        if not isinstance(self.model, torch.nn.Module):
            return False
        blocks = (QuantizedWeight, RowStackedWeight)
        return any(isinstance(getattr(module, "quantized", None), blocks) for module in self.model.modules())

    @property
    def rank_spec(self) -> ModelSpec:
        """This rank's part of the model (its heads and KV heads size its KV cache); `spec` when unsplit."""
        return self.model.rank_spec
