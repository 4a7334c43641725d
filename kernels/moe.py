"""A mixture-of-experts layer's expert products, tokens grouped by expert.

Each token picked `top_k` experts with a weight each (the model's router). Rather than run every expert on every
token, or mask the batch once per expert, the flat (token, k) assignments are sorted by expert (one argsort):
the tokens of one expert are then one run of rows, gathered once. Each expert multiplies its run through its
gated MLP (gate/up fused, SiLU, down) with the backend's own products, float or in a block format as stored
(kernels/quantized.py on the CPU, the Triton kernels on CUDA), and the weighted results go back on their tokens
(a scatter-add; for few tokens a gather into (token, k) order and a sum over k). The only loop is over experts;
an expert no token picked costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.kernels.backend import KernelBackend
from pagedserve.kernels.stacked_weight import ProjectionWeight

ExpertWeight = torch.Tensor | ProjectionWeight  # float [out, in], or blocks as the backend placed them


@dataclass(frozen=True)
class ExpertWeights:
    """Every expert's gated MLP: gate_up[e] is [2 * intermediate, hidden] (gate rows, then up rows), down[e] is
    [hidden, intermediate]."""

    gate_up: torch.Tensor | Sequence[ExpertWeight]  # a float stack [E, 2I, hidden], or one weight per expert
    down: torch.Tensor | Sequence[ExpertWeight]

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)


# Assignments (tokens x k) up to which the experts' outputs return to their tokens by one gather into (token, k)
# order and a sum over k; above it, each expert's rows are gathered from x and scatter-added back on their own
# (measured, benchmarks/moe.py's expert layer on 2 cores: the gather and sum take 1.2 ms at 1 token where the
# scatter-adds take 1.7, and 320 ms at 2048 tokens against 190: four more passes over [T * k, hidden]).
GATHER_SUM_MAX_ROWS = 256


@dataclass(frozen=True)
class ExpertGroups:
    """The flat (token, k) assignments sorted by expert: grouped row i is token `tokens[i]` with routing weight
    `scales[i]`, expert e's rows are the run `bounds[e]:bounds[e + 1]`, and assignment j (= token * k + slot) is
    grouped row `positions[j]`."""

    tokens: torch.Tensor  # [T * k] int64
    scales: torch.Tensor  # [T * k]
    positions: torch.Tensor  # [T * k] int64
    bounds: list[int]  # [num_experts + 1], on the host: the loop over experts reads them

    def runs(self) -> list[tuple[int, int, int]]:
        """(expert, start, stop) of every expert with rows."""
        edges = zip(self.bounds[:-1], self.bounds[1:], strict=True)
        return [(expert, start, stop) for expert, (start, stop) in enumerate(edges) if start < stop]


def group_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sorts the assignments topk_ids [T, k] (and their weights) by expert."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    positions = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
    counts = torch.bincount(flat, minlength=num_experts)
    bounds = [0, *torch.cumsum(counts, 0).tolist()]  # one device-to-host copy per layer
    scales = topk_weights.reshape(-1).index_select(0, order)
    return ExpertGroups(order // topk_ids.shape[-1], scales, positions, bounds)


def _multiply(backend: KernelBackend, x: torch.Tensor, weight: ExpertWeight) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return backend.linear(x, weight)
    return backend.quantized_linear(x, weight)


def expert_mlp(backend: KernelBackend, x: torch.Tensor, gate_up: ExpertWeight, down: ExpertWeight) -> torch.Tensor:
    """One expert's SwiGLU on rows x [N, hidden] -> [N, hidden] (in the backend's output layout)."""
    return _multiply(backend, backend.silu_and_mul(_multiply(backend, x, gate_up)), down)


def grouped_expert_product(
    backend: KernelBackend,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: ExpertWeights,
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), for x [T, hidden] -> [T, hidden]
    token-major (x may be in either layout)."""
    groups = group_by_expert(topk_ids, topk_weights, experts.num_experts)
    if len(groups.tokens) > GATHER_SUM_MAX_ROWS:
        out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        for expert, start, stop in groups.runs():
            tokens = groups.tokens[start:stop]
            y = expert_mlp(backend, x.index_select(0, tokens), experts.gate_up[expert], experts.down[expert])
            out.index_add_(0, tokens, y * groups.scales[start:stop].to(y.dtype).unsqueeze(-1))
        return out
    rows = x.index_select(0, groups.tokens)  # the grouped batch: one gather, token-major
    products = torch.empty_like(rows)
    for expert, start, stop in groups.runs():
        products[start:stop] = expert_mlp(backend, rows[start:stop], experts.gate_up[expert], experts.down[expert])
    # Back in (token, k) order: every token has exactly k rows, so the scatter-add is a gather and a sum over k.
    per_token = products.index_select(0, groups.positions).view(*topk_ids.shape, -1)
    return (per_token * topk_weights.to(products.dtype).unsqueeze(-1)).sum(dim=1)


def expert_product(
    backend: KernelBackend,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: ExpertWeights,
) -> torch.Tensor:
    """The layer's sum over experts on `backend`: Triton's fused kernels (kernels/triton_moe.py) for float expert
    stacks, the grouped product with the backend's own products elsewhere (block formats, the CPU)."""
    if (
        backend.name == "triton"
        and isinstance(experts.gate_up, torch.Tensor)
        and isinstance(experts.down, torch.Tensor)
    ):
        from pagedserve.kernels.triton_moe import fused_expert_product  # imports triton: only where it runs

        return fused_expert_product(x, topk_ids, topk_weights, experts.gate_up, experts.down)
    return grouped_expert_product(backend, x, topk_ids, topk_weights, experts)


def masked_expert_product(
    backend: KernelBackend,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: ExpertWeights,
) -> torch.Tensor:
    """The same sum, one boolean mask over the batch per expert (transformers' loop): what the grouped product
    is measured against (benchmarks/moe.py)."""
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    for expert in range(experts.num_experts):
        token, slot = torch.where(topk_ids == expert)
        if token.numel():
            y = expert_mlp(backend, x[token], experts.gate_up[expert], experts.down[expert])
            out.index_add_(0, token, y * topk_weights[token, slot].to(y.dtype).unsqueeze(-1))
    return out
