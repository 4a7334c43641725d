"""Mixture-of-experts decoders: Qwen3-MoE, Mixtral and OLMoE, the Llama family with a routed expert layer.

Each token's router picks `top_k` of the experts (softmax over all of them, then the top k, renormalised over
those k where the family does so); the experts run grouped by expert (kernels/moe.py). Attention is Llama's,
with Qwen3-MoE's per-head q/k norms or OLMoE's norms over the whole q and k projections.

Split over tensor-parallel ranks, every rank holds every expert's slice of the intermediate width (as the dense
MLP is split): gate/up rows and down columns; the layer's sum over experts is then one all-reduce.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
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
from pagedserve.engine.worker.models.spec import ModelSpec
from pagedserve.kernels import KernelBackend
from pagedserve.kernels.moe import ExpertWeight, ExpertWeights, expert_product

MOE_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
}
# A per-expert checkpoint tensor: layer, expert, projection (Mixtral's w1/w3/w2 are gate/up/down).
EXPERT_TENSOR = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
MIXTRAL_NAMES = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


@dataclass(frozen=True)
class MoeSpec:
    """What a mixture-of-experts checkpoint adds to ModelSpec."""

    family: str
    num_experts: int
    top_k: int
    expert_intermediate_size: int  # every expert's width (the whole model's, not a rank's)
    renormalize: bool  # the top-k weights divided by their sum
    sparse_layers: frozenset[int]  # layers with experts; the others have a dense MLP (Qwen3-MoE)
    clip_qkv: float | None  # OLMoE: q, k and v clamped to +-clip_qkv

    @classmethod
    def from_hf_config(cls, config: Any, architecture: str) -> MoeSpec:
        family = MOE_ARCHITECTURES[architecture]
        layers = frozenset(range(config.num_hidden_layers))
        if family == "mixtral":  # always renormalised over the top k
            experts, width, renormalize, sparse = config.num_local_experts, config.intermediate_size, True, layers
        elif family == "olmoe":  # norm_topk_prob: false in OLMoE's checkpoints
            experts, width, sparse = config.num_experts, config.intermediate_size, layers
            renormalize = bool(config.norm_topk_prob)
        else:  # Qwen3-MoE: dense layers where mlp_only_layers or decoder_sparse_step say so
            experts, width, renormalize = config.num_experts, config.moe_intermediate_size, bool(config.norm_topk_prob)
            step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or ())
            sparse = frozenset(i for i in layers if i not in dense and experts > 0 and (i + 1) % step == 0)
        clip = getattr(config, "clip_qkv", None) if family == "olmoe" else None
        return cls(family, experts, config.num_experts_per_tok, width, renormalize, sparse, clip)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k]): softmax in float32 over every expert, the top k,
    renormalised over them where the family does so (transformers' order of operations)."""
    probabilities = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class Router(nn.Module):
    """The router's weight [num_experts, hidden], float always: its logits pick the experts."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size), requires_grad=False)


class ExpertStack(nn.Module):
    """Every expert's gated MLP, stacked by rows: gate_up_proj [E * 2I, H] (each expert's gate rows, then its up
    rows), down_proj [E * H, I]; or each expert's weights in a block format (`use_quantized`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts * 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts * hidden_size, intermediate_size))
        if not self.gate_up_proj.is_meta:  # random until loaded (load_format "dummy" keeps them)
            nn.init.normal_(self.gate_up_proj, std=0.02)
            nn.init.normal_(self.down_proj, std=0.02)
        self.quantized: ExpertWeights | None = None

    def weights(self) -> ExpertWeights:
        if self.quantized is not None:
            return self.quantized
        experts, hidden, inter = self.num_experts, self.hidden_size, self.intermediate_size
        return ExpertWeights(
            self.gate_up_proj.view(experts, 2 * inter, hidden), self.down_proj.view(experts, hidden, inter)
        )

    def use_quantized(self, gate_up: Sequence[ExpertWeight], down: Sequence[ExpertWeight]) -> None:
        """Multiplies by these per-expert weights from now on and drops the float stacks."""
        expected = ((2 * self.intermediate_size, self.hidden_size), (self.hidden_size, self.intermediate_size))
        for weights, shape in zip((gate_up, down), expected, strict=True):
            if len(weights) != self.num_experts or any(tuple(w.shape) != shape for w in weights):
                raise ValueError(f"expected {self.num_experts} expert weights of shape {shape}")
        self.quantized = ExpertWeights(tuple(gate_up), tuple(down))
        self.gate_up_proj = nn.Parameter(torch.empty(0, self.hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(0, self.intermediate_size), requires_grad=False)


class SparseMoeBlock(nn.Module):
    """Router, then the experts grouped by expert; split over ranks, one all-reduce of the summed outputs."""

    def __init__(
        self, hidden_size: int, moe: MoeSpec, backend: KernelBackend, group: TensorParallelGroup | None
    ) -> None:
        super().__init__()
        ranks = 1 if group is None else group.size
        self.gate = Router(hidden_size, moe.num_experts)
        self.experts = ExpertStack(moe.num_experts, hidden_size, moe.expert_intermediate_size // ranks)
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.backend, self.group = backend, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.backend.linear(x, self.gate.weight), self.top_k, self.renormalize)
        out = expert_product(self.backend, x, ids, weights, self.experts.weights())
        if self.group is not None:
            out = self.group.all_reduce(out)
        return self.backend.in_linear_output_layout(out)


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
        if self.moe.expert_intermediate_size % size:
            raise ValueError(
                f"{spec.architecture} cannot be split over tensor_parallel_size {size}: the experts' "
                f"intermediate size {self.moe.expert_intermediate_size} is not divisible by it"
            )
        super().__init__(spec, hf_config, backend, max_positions, group, rotary)

    def decoder_layer(self, index: int) -> nn.Module:
        return MoeDecoderLayer(self.rank_spec, self.moe, index, self.backend, self.group)

    def weight_target(self, hf_name: str) -> tuple[str, tuple[int, int] | None] | None:
        name = canonical_name(hf_name)
        match = EXPERT_TENSOR.match(name)
        if match is None:
            return super().weight_target(name)
        layer, expert, projection = int(match[1]), int(match[2]), match[3]
        inter = self.moe.expert_intermediate_size // (1 if self.group is None else self.group.size)
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
        if self.moe.family == "olmoe" and name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            projection = name.replace("_norm.weight", "_proj.weight")  # a whole-projection norm: its heads' part
            return super().checkpoint_slice(projection)
        return super().checkpoint_slice(name)


def canonical_name(hf_name: str) -> str:
    """Mixtral's tensor names as the other families spell them (block_sparse_moe -> mlp, w1/w3/w2 -> gate/up/down)."""
    if "block_sparse_moe." not in hf_name:
        return hf_name
    for old, new in MIXTRAL_NAMES.items():
        hf_name = hf_name.replace(old, new)
    return hf_name
