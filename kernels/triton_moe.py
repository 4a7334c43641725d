"""Triton fused expert layer: every expert's gated MLP over its tokens in two launches, for float expert stacks.

The flat (token, k) assignments are sorted by expert and each expert's run padded to a multiple of BLOCK_M
(`align_by_expert`, device ops only: no host sync, so its shapes depend on the token count alone). A tile of
BLOCK_M rows then belongs to one expert: the first kernel gathers the rows' tokens from x, multiplies them by
that expert's gate and up rows (two tl.dot accumulators) and writes SiLU(gate) * up to the assignments' rows;
the second multiplies those by the expert's down weight, scales by the routing weight and writes [T * k, hidden],
which a sum over k turns into the layer's output. Float32 products use IEEE precision (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N, BLOCK_K = 64, 32


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    assignments_ptr,
    block_experts_ptr,
    top_k,
    hidden,
    inter,
    stride_x,
    stride_w_expert,
    stride_w_row,
    stride_act,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (m, n): grouped rows m * BLOCK_M.. (one expert's) x intermediate columns n * BLOCK_N.."""
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:  # a tile past the last expert's padded run
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(assignments_ptr + rows).to(tl.int64)
    valid = assignment >= 0  # padding rows are -1
    token = tl.where(valid, assignment // top_k, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    weights = w_ptr + expert * stride_w_expert
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, hidden, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + token[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = col_ok[None, :] & k_ok[:, None]
        w_gate = tl.load(weights + cols[None, :] * stride_w_row + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(weights + (cols[None, :] + inter) * stride_w_row + ks[:, None], mask=w_mask, other=0.0)
        gate = tl.dot(a, w_gate, acc=gate, input_precision="ieee")
        up = tl.dot(a, w_up, acc=up, input_precision="ieee")
    act = gate * tl.sigmoid(gate) * up
    out = act_ptr + assignment[:, None] * stride_act + cols[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    scales_ptr,
    assignments_ptr,
    block_experts_ptr,
    hidden,
    inter,
    stride_act,
    stride_w_expert,
    stride_w_row,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (m, n): grouped rows m * BLOCK_M.. x hidden columns n * BLOCK_N.., scaled by the routing weight."""
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(assignments_ptr + rows).to(tl.int64)
    valid = assignment >= 0
    safe = tl.where(valid, assignment, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    weights = w_ptr + expert * stride_w_expert
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, inter, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(act_ptr + safe[:, None] * stride_act + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(
            weights + cols[None, :] * stride_w_row + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0
        )
        acc = tl.dot(a, w, acc=acc, input_precision="ieee")
    scale = tl.load(scales_ptr + safe, mask=valid, other=0.0).to(tl.float32)
    out = out_ptr + safe[:, None] * stride_out + cols[None, :]
    tl.store(out, (acc * scale[:, None]).to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def block_rows(assignments: int) -> int:
    """BLOCK_M: decode steps' few rows per expert waste less of a small tile."""
    return 16 if assignments <= 256 else 64


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(assignments [capacity]: the flat (token, k) index of each grouped row, -1 on padding; block_experts
    [capacity / block_m]: each tile's expert, -1 past the last run). Each expert's run starts on a tile; the
    capacity bounds every routing of this many assignments."""
    flat = topk_ids.reshape(-1)
    count = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    sorted_experts = flat[order]
    rank_in_run = torch.arange(count, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    places = (padded_ends - padded)[sorted_experts] + rank_in_run
    capacity = -(-(count + min(num_experts, count) * (block_m - 1)) // block_m) * block_m
    assignments = torch.full((capacity,), -1, dtype=torch.int64, device=flat.device)
    assignments[places] = order
    tile_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_ends, tile_starts, right=True)
    return assignments, torch.where(block_experts < num_experts, block_experts, -1)


def fused_expert_product(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]): x [T, hidden], gate_up [E, 2I, hidden]
    (gate rows, then up rows), down [E, hidden, I] -> [T, hidden]."""
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    tokens, top_k = topk_ids.shape
    experts, hidden, inter = down.shape
    block_m = block_rows(tokens * top_k)
    assignments, block_experts = align_by_expert(topk_ids, experts, block_m)
    tiles = block_experts.numel()
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(tiles, triton.cdiv(inter, BLOCK_N))](
        x, gate_up, act, assignments, block_experts, top_k, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    out = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    scales = topk_weights.reshape(-1).contiguous()
    _down_kernel[(tiles, triton.cdiv(hidden, BLOCK_N))](
        act, down, out, scales, assignments, block_experts, hidden, inter,
        act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out.view(tokens, top_k, hidden).sum(dim=1)
