"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE, the Llama family with a routed expert
layer (models/moe_blocks.py).

Each token's router picks `top_k` of the experts (softmax over all of them, then the top k, renormalised over
those k where the family does so); the experts run grouped by expert (kernels/moe.py). Attention is Llama's,
with Qwen3-MoE's per-head q/k norms, Qwen2-MoE's q/k/v biases or OLMoE's norms over the whole q and k
projections.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from torch import nn

from pagedserve.engine.worker.distributed.group import TensorParallelGroup
from pagedserve.engine.worker.models.layers import GatedMLP, RMSNorm
from pagedserve.engine.worker.models.llama import (
    CheckpointSlice,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from pagedserve.engine.worker.models.moe_attention import WholeProjectionNormAttention
from pagedserve.engine.worker.models.moe_blocks import SparseMoeBlock
from pagedserve.engine.worker.models.moe_spec import MoeSpec
from pagedserve.engine.worker.models.spec import ModelSpec
from pagedserve.kernels import KernelBackend

# A per-expert checkpoint tensor: layer, expert, projection (Mixtral's w1/w3/w2 are gate/up/down).
EXPERT_TENSOR = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Qwen2-MoE's shared expert: layer, projection.
SHARED_EXPERT_TENSOR = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight$"
)
MIXTRAL_NAMES = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


class MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(
        self, spec: ModelSpec, moe: MoeSpec, index: int, backend: KernelBackend, group: TensorParallelGroup | None
    ) -> None:
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: it would build a dense MLP first
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        self.self_attn: LlamaAttention = (
            WholeProjectionNormAttention(spec, backend, group, moe.clip_qkv)
            if moe.family == "olmoe"
            else LlamaAttention(dataclasses.replace(spec, qk_norm=moe.family == "qwen3_moe"), backend, group)
        )
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        mlp: nn.Module = (
            SparseMoeBlock(spec.hidden_size, moe, backend, group)
            if index in moe.sparse_layers
            else GatedMLP(spec.hidden_size, spec.intermediate_size, backend, group)
        )
        self.mlp = mlp  # type: ignore[assignment]  # experts where LlamaDecoderLayer has its GatedMLP


class MoeForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM with MoeDecoderLayer; loads per-expert checkpoint tensors into the expert stacks."""

    # The grouped expert product sizes its per-expert products on the host, from each step's routing: a
    # recorded CUDA graph would replay one step's sizes (engine/worker/executor.py reads this).
    records_in_cuda_graphs = False

    def __init__(
        self,
        spec: ModelSpec,
        hf_config: Any,
        backend: KernelBackend,
        max_positions: int,
        group: TensorParallelGroup | None = None,
        rotary: Any = None,
    ) -> None:
        self.moe = MoeSpec.from_hf_config(hf_config, spec.architecture)
        size = 1 if group is None else group.size
        problems = self.moe.split_problems(size)
        if problems:
            raise ValueError(
                f"{spec.architecture} cannot be split over tensor_parallel_size {size}: "
                f"{', '.join(problems)} not divisible by it"
            )
        super().__init__(spec, hf_config, backend, max_positions, group, rotary)

    def decoder_layer(self, index: int) -> nn.Module:
        return MoeDecoderLayer(self.rank_spec, self.moe, index, self.backend, self.group)

    def weight_target(self, hf_name: str) -> tuple[str, tuple[int, int] | None] | None:
        name = canonical_name(hf_name)
        shared = SHARED_EXPERT_TENSOR.match(name)
        if shared is not None:  # gate and up fused, as the dense MLP's
            layer, projection, width = (
                int(shared[1]),
                shared[2],
                self._rank_width(self.moe.shared_expert_intermediate_size),
            )
            if projection == "down_proj":
                return f"layers.{layer}.mlp.shared_expert.down_proj.weight", None
            first = width if projection == "up_proj" else 0
            return f"layers.{layer}.mlp.shared_expert.gate_up_proj.weight", (first, first + width)
        match = EXPERT_TENSOR.match(name)
        if match is None:
            return super().weight_target(name)
        layer, expert, projection = int(match[1]), int(match[2]), match[3]
        inter = self._rank_width(self.moe.expert_intermediate_size)
        if projection == "down_proj":
            hidden = self.spec.hidden_size
            return f"layers.{layer}.mlp.experts.down_proj", (expert * hidden, (expert + 1) * hidden)
        first = expert * 2 * inter + (inter if projection == "up_proj" else 0)
        return f"layers.{layer}.mlp.experts.gate_up_proj", (first, first + inter)

    def checkpoint_slice(self, hf_name: str) -> CheckpointSlice | None:
        if self.group is None:
            return None
        name = canonical_name(hf_name)
        rank, size = self.group.rank, self.group.size
        match = EXPERT_TENSOR.match(name)
        if match is not None:
            inter = self.moe.expert_intermediate_size // size
            return (1 if match[3] == "down_proj" else 0), rank * inter, (rank + 1) * inter
        shared = SHARED_EXPERT_TENSOR.match(name)
        if shared is not None:
            width = self.moe.shared_expert_intermediate_size // size
            return (1 if shared[2] == "down_proj" else 0), rank * width, (rank + 1) * width
        if self.moe.family == "olmoe" and name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            projection = name.replace("_norm.weight", "_proj.weight")  # a whole-projection norm: its heads' part
            return super().checkpoint_slice(projection)
        return super().checkpoint_slice(name)

    def _rank_width(self, width: int) -> int:
        return width // (1 if self.group is None else self.group.size)


def canonical_name(hf_name: str) -> str:
    """Mixtral's tensor names as the other families spell them (block_sparse_moe -> mlp, w1/w3/w2 -> gate/up/down)."""
    if "block_sparse_moe." not in hf_name:
        return hf_name
    for old, new in MIXTRAL_NAMES.items():
        hf_name = hf_name.replace(old, new)
    return hf_name
