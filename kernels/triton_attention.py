"""Triton paged attention: one kernel for prefill chunks, decodes and mixed batches.

A program owns one query tile of one sequence and one KV head. The tile's rows are (query token, query head)
pairs for all query heads sharing that KV head, flattened into the M dimension of `tl.dot`, so each K/V tile
is read once per group rather than once per query head. Keys are gathered through the block table position
by position, so a KV tile may span several cache blocks and the block size is free of the tile size.

Flash-decoding: with few query tiles and long contexts the KV range is cut into `num_splits` parts handled by
separate programs that write partial (max, sum, unnormalized output); `_merge_splits_kernel` combines them.
Scores live in the log2 domain (the scale is premultiplied by log2(e)) so the softmax uses `exp2`.

Per call, a layer may attend over a sliding window (each row sees only the last `window` keys up to its own; the
key tiles before a tile's first window are skipped) and soft-cap its scores, cap * tanh(score / cap) (Gemma 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Rows (query tokens x grouped heads) of a prefill tile, and the floor that `tl.dot` needs on GPUs.
PREFILL_TILE_ROWS = 64
MIN_DOT_SIZE = 16
NO_WINDOW = 1 << 30  # the window of a layer that sees its whole context
LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class TileShape:
    tile_tokens: int  # query tokens of one sequence per tile
    block_m: int  # tile rows: tile_tokens x group, padded to a power of two >= 16
    block_n: int  # keys per inner-loop step
    num_warps: int


def choose_tile_shape(group: int, head_dim: int, decode_like: bool) -> TileShape:
    """Decode tiles hold one token (its whole head group); prefill tiles fill about 64 rows."""
    tile_tokens = 1 if decode_like else max(1, PREFILL_TILE_ROWS // group)
    block_m = max(MIN_DOT_SIZE, triton.next_power_of_2(tile_tokens * group))
    head_dim_pad = triton.next_power_of_2(head_dim)
    block_n = 64 if head_dim_pad <= 128 else 32  # keeps K+V tiles of every pipeline stage in shared memory
    num_warps = 8 if block_m * head_dim_pad >= 128 * 128 else 4
    return TileShape(tile_tokens, block_m, block_n, num_warps)


@dataclass(frozen=True)
class AttentionLaunch:
    """Everything a step's layers share to launch attention; built on the host from host-side lengths."""

    tiles: torch.Tensor  # [2, num_tiles] int32 on the device: sequence and first query token of each tile
    shape: TileShape
    num_splits: int  # KV-range splits per tile (1 = no flash-decoding)

    @property
    def num_tiles(self) -> int:
        return self.tiles.shape[1]


@triton.jit
def _attend_kv_range(
    q,
    acc,
    row_max,
    row_sum,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_head,
    first_tile,
    end_tile,
    kv_end,
    row_last_key,
    window,
    scale_log2e,
    cap_inner,
    cap_outer,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    """Online softmax over key tiles [first_tile, end_tile); each row sees the `window` keys up to row_last_key.
    SOFT_CAP: scores are cap_outer * tanh(q.k * cap_inner), cap_inner = scale / cap, cap_outer = cap * log2(e)."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    for kv_tile in range(first_tile, end_tile):
        key_pos = kv_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_valid = key_pos < kv_end
        block = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
        slot_offsets = (
            block.to(tl.int64) * stride_cache_block
            + (key_pos % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        k = tl.load(
            k_cache_ptr + slot_offsets[None, :] + dims[:, None],
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )
        # "ieee" keeps float32 exact on tensor-core GPUs; it is ignored for 16-bit inputs.
        scores = tl.dot(q, k, input_precision="ieee")
        if SOFT_CAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp overflowing to inf gives 1).
            scores = (1.0 - 2.0 / (tl.exp(2.0 * cap_inner * scores) + 1.0)) * cap_outer
        else:
            scores = scores * scale_log2e
        in_window = key_pos[None, :] > row_last_key[:, None] - window
        visible = key_valid[None, :] & (key_pos[None, :] <= row_last_key[:, None]) & in_window
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # A row that has seen no key yet (possible inside a split) keeps max -inf: shift by 0, not -inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        v = tl.load(
            v_cache_ptr + slot_offsets[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        acc = tl.dot(probs.to(v.dtype), v, acc=acc * rescale[:, None], input_precision="ieee")
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_seqs_ptr,
    tile_starts_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2e,
    cap_inner,
    cap_outer,
    window,
    num_splits,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    stride_part_split,
    stride_part_token,
    GROUP: tl.constexpr,
    TILE_TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    """Grid (query tile, KV head, KV split)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seqs_ptr + tile)
    tile_start = tl.load(tile_starts_ptr + tile)
    query_begin = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_begin
    context_len = tl.load(seq_lens_ptr + seq) - query_len  # the new tokens are the last query_len positions

    rows = tl.arange(0, BLOCK_M)
    token = tile_start + rows // GROUP  # query token index inside the sequence's new tokens
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < TILE_TOKENS * GROUP) & (token < query_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    io_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    query_row = (query_begin + token).to(tl.int64)
    q = tl.load(
        query_ptr + query_row[:, None] * stride_query_token + head[:, None] * stride_query_head + dims[None, :],
        mask=io_mask,
        other=0.0,
    )

    # Keys from the first token's window to the last token; this program takes its split's share of those tiles.
    kv_end = context_len + tl.minimum(tile_start + TILE_TOKENS, query_len)
    kv_tiles = tl.cdiv(kv_end, BLOCK_N)
    window_tile = tl.maximum(context_len + tile_start - window + 1, 0) // BLOCK_N
    tiles_per_split = tl.cdiv(kv_tiles - window_tile, num_splits)
    first_tile = window_tile + split * tiles_per_split
    end_tile = tl.minimum(first_tile + tiles_per_split, kv_tiles)
    acc, row_max, row_sum = _attend_kv_range(
        q,
        tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32),
        tl.full([BLOCK_M], float("-inf"), dtype=tl.float32),
        tl.zeros([BLOCK_M], dtype=tl.float32),
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_block_table,
        kv_head,
        first_tile,
        end_tile,
        kv_end,
        context_len + token,
        window,
        scale_log2e,
        cap_inner,
        cap_outer,
        stride_cache_block,
        stride_cache_slot,
        stride_cache_head,
        BLOCK_N,
        BLOCK_SIZE,
        HEAD_DIM,
        HEAD_DIM_PAD,
        SOFT_CAP,
    )

    if SPLIT_KV:
        part_row = split * stride_part_split + query_row * stride_part_token + head
        tl.store(part_max_ptr + part_row, row_max, mask=row_valid)
        tl.store(part_sum_ptr + part_row, row_sum, mask=row_valid)
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=io_mask)
    else:
        # Every row sees at least its own key, so row_sum > 0; padding rows past a window may see none (not stored).
        out = acc / tl.where(row_valid, row_sum, 1.0)[:, None]
        out_offsets = query_row[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_splits,
    stride_out_token,
    stride_out_head,
    stride_part_split,
    stride_part_token,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Grid (token, head): rescales each split's partial softmax to the global max and normalizes."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_valid = splits < num_splits
    part_row = splits * stride_part_split + token * stride_part_token + head
    split_max = tl.load(part_max_ptr + part_row, mask=split_valid, other=float("-inf"))
    split_sum = tl.load(part_sum_ptr + part_row, mask=split_valid, other=0.0)
    # Some split holds the row's own key, so the global max is finite; empty splits weigh exp2(-inf) = 0.
    weight = tl.exp2(split_max - tl.max(split_max, 0))
    split_acc = tl.load(
        part_acc_ptr + part_row[:, None] * HEAD_DIM_PAD + dims[None, :],
        mask=split_valid[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(split_acc * weight[:, None], 0) / tl.sum(split_sum * weight, 0)
    out_offsets = token * stride_out_token + head * stride_out_head + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    launch: AttentionLaunch,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """query [T, H, D] (any token/head strides, contiguous in D) -> out [T, H, D] contiguous; each token sees the
    last `sliding_window` keys up to its own where that is set, scores soft-capped at `soft_cap` where set.

    Both caches must share one layout, contiguous in head_dim; block_tables must be contiguous in its rows.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    head_dim_pad = triton.next_power_of_2(head_dim)
    split_kv = launch.num_splits > 1
    # fp32 partial max/sum [splits, T, H] and output [splits, T, H, D_pad]; untouched without splits.
    parts = (launch.num_splits, num_tokens, num_heads) if split_kv else (1,)
    part_max = torch.empty(parts, dtype=torch.float32, device=query.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty((*parts, head_dim_pad), dtype=torch.float32, device=query.device)
    part_strides = (num_tokens * num_heads, num_heads)
    shape = launch.shape
    _paged_attention_kernel[(launch.num_tiles, num_kv_heads, launch.num_splits)](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        launch.tiles[0],
        launch.tiles[1],
        part_acc,
        part_max,
        part_sum,
        scale * LOG2E,
        scale / soft_cap if soft_cap else 0.0,
        soft_cap * LOG2E if soft_cap else 0.0,
        sliding_window or NO_WINDOW,
        launch.num_splits,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        *part_strides,
        GROUP=num_heads // num_kv_heads,
        TILE_TOKENS=shape.tile_tokens,
        BLOCK_M=shape.block_m,
        BLOCK_N=shape.block_n,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        SPLIT_KV=split_kv,
        SOFT_CAP=bool(soft_cap),
        num_warps=shape.num_warps,
    )
    if split_kv:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            launch.num_splits,
            out.stride(0),
            out.stride(1),
            *part_strides,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(launch.num_splits),
        )
    return out
