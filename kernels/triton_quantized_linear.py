"""Weight-only quantized linear in Triton: y = x @ W^T + bias with W kept in a ggml block format on the GPU.

W is a DeviceQuantizedWeight (kernels/device_blocks.py: GGUF's bits with scales split from quants). A program
owns a [BLOCK_M, BLOCK_N] tile of y and walks K in BLOCK_K steps of 32-weight chunks: each chunk is
dequantized in registers (kernels/triton_dequant_tiles.py), cast to x's dtype and fed to two `tl.dot`s of
K = 16, accumulating in float32. The output has x's dtype (float16, bfloat16 or float32).

Decode (few tokens) reads every weight byte once and is bound by memory bandwidth: with so few output tiles
the grid would leave most SMs idle, so K is split across programs (split-K) that write float32 partial sums,
added in a fixed order afterwards (deterministic, unlike atomics). Prefill is bound by arithmetic: larger
tiles share each dequantized weight tile among more tokens. The tile table in `choose_tiles` is a first guess
that no GPU has measured yet; benchmarks/triton_quantized_linear.py times it and sweeps alternatives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.device_blocks import NIBBLE_PAIR_DISTANCE, DeviceQuantizedWeight
from pagedserve.kernels.triton_dequant_tiles import CHUNK, CHUNK_WEIGHTS, FORMAT_CODES, dequantized_chunk, run_of_16

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DECODE_ROWS = 16  # tokens up to which a step counts as decode: one BLOCK_M of tl.dot's minimum size
MIN_K_TILES_PER_SPLIT = 4  # below this a split's partial sum costs more than its parallelism gains


@dataclass(frozen=True)
class GemmTiles:
    block_m: int
    block_n: int
    block_k: int  # a multiple of CHUNK_WEIGHTS that divides in_features: no tile runs past K
    split_k: int = 1  # programs sharing one output tile's K range
    num_warps: int = 4
    num_stages: int = 3


def choose_tiles(tokens: int, out_features: int, in_features: int, sm_count: int) -> GemmTiles:
    """Tiles for x [tokens, in] @ W^T; `sm_count` 0 (no GPU, the interpreter) never splits K."""
    if tokens <= DECODE_ROWS:
        tiles = GemmTiles(DECODE_ROWS, 64, block_k_for(in_features, 256), num_warps=4, num_stages=4)
        return _with_split_k(tiles, tokens, out_features, in_features, sm_count)
    block_k = block_k_for(in_features, 128)
    if tokens <= 64:
        return GemmTiles(32 if tokens <= 32 else 64, 64, block_k, num_warps=4)
    if tokens <= 256:
        return GemmTiles(64, 128, block_k, num_warps=8)
    return GemmTiles(128, 128, block_k, num_warps=8)


def block_k_for(in_features: int, preferred: int) -> int:
    """The largest power-of-two multiple of CHUNK_WEIGHTS up to `preferred` that divides in_features."""
    block_k = CHUNK_WEIGHTS
    while block_k * 2 <= preferred and in_features % (block_k * 2) == 0:
        block_k *= 2
    return block_k


def _with_split_k(tiles: GemmTiles, tokens: int, out_features: int, in_features: int, sm_count: int) -> GemmTiles:
    """Splits K until the grid has about two programs per SM, keeping MIN_K_TILES_PER_SPLIT tiles per split."""
    programs = triton.cdiv(tokens, tiles.block_m) * triton.cdiv(out_features, tiles.block_n)
    target = 2 * sm_count
    max_splits = in_features // tiles.block_k // MIN_K_TILES_PER_SPLIT
    if programs >= target or max_splits <= 1:
        return tiles
    split_k = min(triton.cdiv(target, programs), max_splits)
    return GemmTiles(tiles.block_m, tiles.block_n, tiles.block_k, split_k, tiles.num_warps, tiles.num_stages)


@triton.jit
def _quantized_linear_kernel(
    x_ptr,
    out_ptr,
    bias_ptr,
    quants_ptr,
    high_bits_ptr,
    scales_ptr,
    mins_ptr,
    super_scales_ptr,
    super_mins_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_out_split,
    stride_out_m,
    stride_quants,
    stride_high_bits,
    stride_scales,
    stride_super,
    FORMAT: tl.constexpr,
    G: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[split, m, n] = sum over this split's K range of x[m, k] * W[n, k] (+ bias[n] where HAS_BIAS).
    BLOCK_K divides K and k_per_split: no tile runs past K, so only tokens and rows are masked."""
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    token_valid, row_valid = tokens < M, rows < N
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        for i in tl.static_range(BLOCK_K // CHUNK):
            lo, hi, w_lo, w_hi = dequantized_chunk(
                quants_ptr,
                high_bits_ptr,
                scales_ptr,
                mins_ptr,
                super_scales_ptr,
                super_mins_ptr,
                rows.to(tl.int64),
                row_valid,
                k0 // CHUNK + i,
                stride_quants,
                stride_high_bits,
                stride_scales,
                stride_super,
                FORMAT,
                G,
            )
            x_lo = tl.load(x_rows + run_of_16(lo)[None, :] * stride_xk, mask=token_valid[:, None], other=0.0)
            x_hi = tl.load(x_rows + run_of_16(hi)[None, :] * stride_xk, mask=token_valid[:, None], other=0.0)
            # "ieee" keeps float32 activations exact on tensor-core GPUs; it is ignored for 16-bit inputs.
            acc = tl.dot(x_lo, w_lo.to(x_lo.dtype), acc=acc, input_precision="ieee")
            acc = tl.dot(x_hi, w_hi.to(x_hi.dtype), acc=acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_valid, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split * stride_out_split + tokens.to(tl.int64)[:, None] * stride_out_m + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=token_valid[:, None] & row_valid[None, :])


def quantized_linear(
    x: torch.Tensor, weight: DeviceQuantizedWeight, bias: torch.Tensor | None = None, tiles: GemmTiles | None = None
) -> torch.Tensor:
    """x [T, in] @ W^T + bias -> [T, out] in x's dtype, token-major. x may have any strides; `tiles` overrides
    choose_tiles (tests, benchmarks)."""
    _check_operands(x, weight, bias)
    (tokens, _), (out_features, in_features) = x.shape, weight.shape
    if tokens == 0:
        return x.new_empty(0, out_features)
    tiles = tiles or choose_tiles(tokens, out_features, in_features, device_sm_count(x.device))
    if in_features % tiles.block_k != 0 or tiles.block_k % CHUNK_WEIGHTS != 0:
        raise ValueError(f"block_k must be a multiple of {CHUNK_WEIGHTS} dividing {in_features}, got {tiles.block_k}")
    k_per_split = triton.cdiv(triton.cdiv(in_features, tiles.block_k), tiles.split_k) * tiles.block_k
    splits = triton.cdiv(in_features, k_per_split)  # fewer than split_k where K tiles do not divide evenly
    if splits == 1:
        out = x.new_empty(tokens, out_features)
        _launch(x, weight, bias, out, tiles, k_per_split, splits)
        return out
    partials = torch.empty(splits, tokens, out_features, dtype=torch.float32, device=x.device)
    _launch(x, weight, None, partials, tiles, k_per_split, splits)
    summed = partials.sum(dim=0)
    if bias is not None:
        summed += bias.float()
    return summed.to(x.dtype)


def _launch(
    x: torch.Tensor,
    weight: DeviceQuantizedWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    tiles: GemmTiles,
    k_per_split: int,
    splits: int,
) -> None:
    """One launch over all output tiles and K splits; `out` is [T, N] (one split) or [splits, T, N]."""
    (tokens, _), (out_features, in_features) = x.shape, weight.shape
    placeholder = weight.quants  # for the fields a format has not: the kernel never reads them
    high_bits, mins = weight.high_bits, weight.mins
    super_scales, super_mins = weight.super_scales, weight.super_mins
    out_strides = (0, out.stride(0)) if out.dim() == 2 else (out.stride(0), out.stride(1))
    grid = (triton.cdiv(tokens, tiles.block_m), triton.cdiv(out_features, tiles.block_n), splits)
    _quantized_linear_kernel[grid](
        x,
        out,
        placeholder if bias is None else bias,
        weight.quants,
        placeholder if high_bits is None else high_bits,
        weight.scales,
        placeholder if mins is None else mins,
        placeholder if super_scales is None else super_scales,
        placeholder if super_mins is None else super_mins,
        tokens,
        out_features,
        in_features,
        k_per_split,
        x.stride(0),
        x.stride(1),
        *out_strides,
        weight.quants.stride(0),
        0 if high_bits is None else high_bits.stride(0),
        weight.scales.stride(0),
        0 if super_scales is None else super_scales.stride(0),
        FORMAT=FORMAT_CODES[weight.qtype],
        G=NIBBLE_PAIR_DISTANCE[weight.qtype],
        HAS_BIAS=bias is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def _check_operands(x: torch.Tensor, weight: DeviceQuantizedWeight, bias: torch.Tensor | None) -> None:
    """The kernel trusts its pointers: refuse anything it would misread."""
    out_features, in_features = weight.shape
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [tokens, {in_features}], got shape {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES or x.device != weight.device:
        raise ValueError(f"x must be one of {ACTIVATION_DTYPES} on {weight.device}, got {x.dtype} {x.device}")
    if bias is not None and (bias.shape != (out_features,) or bias.device != weight.device or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{out_features}] vector on {weight.device}")


@functools.cache
def device_sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count
