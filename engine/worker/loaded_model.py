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
    def rank_spec(self) -> ModelSpec:
        """This rank's part of the model (its heads and KV heads size its KV cache); `spec` when unsplit."""
        return self.model.rank_spec
