"""CausalLM: what the runner, the CUDA graphs and the KV sizing use of a model, whichever implementation runs."""

from __future__ import annotations

from typing import Protocol

import torch

from pagedserve.engine.worker.distributed.group import TensorParallelGroup
from pagedserve.engine.worker.models.spec import ModelSpec
from pagedserve.kernels import AttentionMetadata, KernelBackend

KVCache = tuple[torch.Tensor, torch.Tensor]


class CausalLM(Protocol):
    """A decoder over the paged KV cache: our own (LlamaForCausalLM) or transformers' modules
    (TransformersForCausalLM)."""

    spec: ModelSpec
    rank_spec: ModelSpec  # this rank's part of the model; `spec` when whole
    group: TensorParallelGroup | None
    backend: KernelBackend

    def bind_kv_caches(self, caches: list[KVCache]) -> None: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of the flat batch."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
