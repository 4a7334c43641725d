"""A mixture-of-experts layer's parts: the router, the experts' stacked weights, and the block that routes each
token to its top k experts (plus, for Qwen2-MoE, a shared expert every token takes through a sigmoid gate).

Split over tensor-parallel ranks, every rank holds every expert's slice of the intermediate width (as the dense
MLP is split), the shared expert's too; the routed and shared partial sums are added, then one all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagedserve.engine.worker.distributed.group import TensorParallelGroup
from pagedserve.engine.worker.models.layers import GatedMLP
from pagedserve.engine.worker.models.moe_spec import MoeSpec
from pagedserve.kernels import KernelBackend
from pagedserve.kernels.moe import ExpertWeight, ExpertWeights, expert_product


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
    """Router, then the experts grouped by expert (and the gated shared expert where the family has one); split
    over ranks, one all-reduce of the summed outputs."""

    def __init__(
        self, hidden_size: int, moe: MoeSpec, backend: KernelBackend, group: TensorParallelGroup | None
    ) -> None:
        super().__init__()
        ranks = 1 if group is None else group.size
        self.gate = Router(hidden_size, moe.num_experts)
        self.experts = ExpertStack(moe.num_experts, hidden_size, moe.expert_intermediate_size // ranks)
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.backend, self.group = backend, group
        self.shared_expert: GatedMLP | None = None
        if moe.shared_expert_intermediate_size:
            # Its rank's slice with no all-reduce of its own: it joins the routed sum before the layer's one.
            self.shared_expert = GatedMLP(hidden_size, moe.shared_expert_intermediate_size // ranks, backend)
            self.shared_expert_gate = Router(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.backend.linear(x, self.gate.weight), self.top_k, self.renormalize)
        out = self.backend.in_linear_output_layout(
            expert_product(self.backend, x, ids, weights, self.experts.weights())
        )
        if self.shared_expert is not None:
            share = torch.sigmoid(self.backend.linear(x, self.shared_expert_gate.weight))  # [T, 1] or [1, T]
            out = out + self.shared_expert(x) * share
        if self.group is not None:
            out = self.group.all_reduce(out)
        return out
