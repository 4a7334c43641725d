"""The grouped expert product (kernels/moe.py) equals a dense per-token reference: every token through each
of its top-k experts one at a time, weighted and summed. Float weights and Q8_0/Q4_K blocks, with the CPU
backend's native kernels and on its torch path, for token counts on either side of the CPU backend's layouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_backend import TRANSPOSED_GEMM_MAX_ROWS, CpuBackend
from pagedserve.kernels.moe import (
    GATHER_SUM_MAX_ROWS,
    ExpertWeights,
    group_by_expert,
    grouped_expert_product,
    masked_expert_product,
)
from pagedserve.kernels.quantized import dequantize, quantize

HIDDEN, INTER, EXPERTS, TOP_K = 256, 256, 8, 2


def random_experts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.05
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.05
    return gate_up, down


def random_routing(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, topk_ids, topk_weights), some experts left without tokens."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    logits = torch.randn(tokens, EXPERTS, generator=gen)
    logits[:, -1] = -1e9  # the last expert gets no token
    weights, ids = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
    return x, ids, weights


def per_token_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up, down) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(TOP_K):
            e = int(ids[t, k])
            gate, up = F.linear(x[t], gate_up[e]).chunk(2)
            out[t] += weights[t, k] * F.linear(F.silu(gate) * up, down[e])
    return out


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("tokens", [1, 7, GATHER_SUM_MAX_ROWS // TOP_K + 1, TRANSPOSED_GEMM_MAX_ROWS + 5])
def test_float_experts_equal_per_token_reference(native: bool, tokens: int) -> None:
    gate_up, down = random_experts()
    x, ids, weights = random_routing(tokens)
    backend = CpuBackend(native=native)
    got = grouped_expert_product(backend, x, ids, weights, ExpertWeights(gate_up, down))
    expected = per_token_reference(x, ids, weights, gate_up, down)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    naive = masked_expert_product(backend, x, ids, weights, ExpertWeights(gate_up, down))
    torch.testing.assert_close(naive, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k"])
@pytest.mark.parametrize("tokens", [1, 20, GATHER_SUM_MAX_ROWS])
def test_block_experts_equal_the_dequantized_reference(qtype: str, tokens: int) -> None:
    gate_up, down = random_experts()
    blocks_gate_up = [quantize(w, qtype) for w in gate_up]
    blocks_down = [quantize(w, qtype) for w in down]
    x, ids, weights = random_routing(tokens)
    x_feature_major = x.t().contiguous().t()  # the layout the CPU backend's products leave small batches in
    got = grouped_expert_product(
        CpuBackend(), x_feature_major, ids, weights, ExpertWeights(blocks_gate_up, blocks_down)
    )
    dequantized = (
        torch.stack([dequantize(w) for w in blocks_gate_up]),
        torch.stack([dequantize(w) for w in blocks_down]),
    )
    torch.testing.assert_close(got, per_token_reference(x, ids, weights, *dequantized), rtol=1e-4, atol=1e-4)


def test_groups_are_runs_of_one_expert() -> None:
    ids = torch.tensor([[3, 0], [0, 2], [3, 2]])
    weights = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    groups = group_by_expert(ids, weights, num_experts=4)
    assert groups.bounds == [0, 2, 2, 4, 6] and groups.runs() == [(0, 0, 2), (2, 2, 4), (3, 4, 6)]  # 1: no rows
    assert groups.tokens.tolist() == [0, 1, 1, 2, 0, 2]
    assert groups.scales.tolist() == [1.0, 2.0, 3.0, 5.0, 0.0, 4.0]
    assert groups.positions.tolist() == [4, 0, 1, 2, 5, 3]  # (token 0, slot 0) is the 5th grouped row
