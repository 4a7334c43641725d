"""Triton helper that dequantizes one chunk of a block-format weight (kernels/device_blocks.py's layout).

A chunk is 32 weights of each of BLOCK_N output rows: in the 4-bit formats and Q6_K's low bits, 16 quant bytes
of a row, byte j holding weight lo + j in its low nibble and weight hi + j in its high one, where the chunk's
columns lo and hi lie G apart (G = the format's nibble-pair distance, device_blocks.NIBBLE_PAIR_DISTANCE).
Q8_0 takes G = 16: a chunk is one of its blocks, lo its first 16 weights and hi the rest. The chunk comes back
as two halves [16, BLOCK_N] of float32 (K-major: tl.dot's second operand) that the caller multiplies by the
activations at columns lo..lo+15 and hi..hi+15, so nibbles are never shuffled back into weight order.

Every scale, min and high-bit shift is constant within a half (blocks of 32, Q4_K's sub-blocks of 32, Q6_K's
scales per 16 and its qh bit pairs per 32), so scales load as one value per row, not one per weight: that keeps
the tiles in registers. Each format's arithmetic is the reference's (kernels/quantized_reference.py), the same
float32 operations in the same order (compiled, a multiply and an add may fuse into one rounding). Rows past N
load zeros, so they dequantize to 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

FORMAT_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q4_k": 3, "q5_k": 4, "q6_k": 5}
FORMAT_CODES |= {"q5_0": 6, "q5_1": 7, "q2_k": 8, "q3_k": 9}
Q8_0 = tl.constexpr(0)
Q4_0 = tl.constexpr(1)
Q4_1 = tl.constexpr(2)
Q4_K = tl.constexpr(3)
Q5_K = tl.constexpr(4)
Q6_K = tl.constexpr(5)
Q5_0 = tl.constexpr(6)
Q5_1 = tl.constexpr(7)
Q2_K = tl.constexpr(8)  # the last two: the formats of 2-bit fields
Q3_K = tl.constexpr(9)
CHUNK_WEIGHTS = 32  # per row, per chunk
CHUNK = tl.constexpr(CHUNK_WEIGHTS)  # the same, for kernels (they read only constexpr globals)
HALF = tl.constexpr(16)  # weights of one half: the smallest K of tl.dot


@triton.jit
def dequantized_chunk(
    quants_ptr,
    high_bits_ptr,
    scales_ptr,
    mins_ptr,
    super_scales_ptr,
    super_mins_ptr,
    rows,
    row_valid,
    chunk,
    stride_quants,
    stride_high_bits,
    stride_scales,
    stride_super,
    FORMAT: tl.constexpr,
    G: tl.constexpr,
):
    """(lo, hi, lo weights, hi weights): chunk `chunk` (its first byte is 16 * chunk) of output rows `rows`
    (int64 [BLOCK_N]), the halves [16, BLOCK_N] float32 of columns lo..lo+15 and hi..hi+15."""
    if FORMAT >= Q2_K:  # Q2_K, Q3_K: fields of 2 bits
        first_byte = _two_bit_first_byte(chunk)
        lo = _two_bit_lo(chunk)
    else:
        first_byte = chunk * 16
        lo = (first_byte // G) * (2 * G) + first_byte % G
    hi = lo + G
    valid = row_valid[None, :]
    scale_rows = scales_ptr + rows * stride_scales
    if FORMAT == Q8_0:
        d = _per_row(scale_rows, chunk, row_valid)
        quant_rows = quants_ptr + rows[None, :] * stride_quants
        w_lo = tl.load(quant_rows + run_of_16(lo)[:, None], mask=valid, other=0).to(tl.float32) * d
        w_hi = tl.load(quant_rows + run_of_16(hi)[:, None], mask=valid, other=0).to(tl.float32) * d
    elif FORMAT >= Q2_K:
        packed_rows = quants_ptr + rows[None, :] * stride_quants
        packed = tl.load(packed_rows + run_of_16(first_byte)[:, None], mask=valid, other=0).to(tl.int32)
        shift = (chunk % 2) * 4  # lo's field s = 2 * (chunk % 2), hi's s + 1
        q_lo, q_hi = (packed >> shift) & 3, (packed >> (shift + 2)) & 3
        d = _per_row(super_scales_ptr + rows * stride_super, lo // 256, row_valid)
        if FORMAT == Q2_K:
            dmin = _per_row(super_mins_ptr + rows * stride_super, lo // 256, row_valid)
            w_lo = _q2_k_weights(scale_rows, row_valid, lo // 16, d, dmin, q_lo)
            w_hi = _q2_k_weights(scale_rows, row_valid, hi // 16, d, dmin, q_hi)
        else:
            high_bit_rows = high_bits_ptr + rows[None, :] * stride_high_bits
            q_lo, q_hi = _q3_k_values(high_bit_rows, valid, lo, q_lo, q_hi)
            w_lo = (d * _q3_k_scale(scale_rows, row_valid, lo // 16)) * q_lo.to(tl.float32)
            w_hi = (d * _q3_k_scale(scale_rows, row_valid, hi // 16)) * q_hi.to(tl.float32)
    else:
        packed_rows = quants_ptr + rows[None, :] * stride_quants
        packed = tl.load(packed_rows + run_of_16(first_byte)[:, None], mask=valid, other=0).to(tl.int32)
        q_lo, q_hi = packed & 0x0F, packed >> 4
        if FORMAT == Q5_0:
            q_lo, q_hi = _q5_fifth_bits(high_bits_ptr + rows * stride_high_bits, row_valid, chunk, q_lo, q_hi)
            d = _per_row(scale_rows, chunk, row_valid)
            w_lo, w_hi = d * (q_lo - 16).to(tl.float32), d * (q_hi - 16).to(tl.float32)
        elif FORMAT == Q5_1:
            q_lo, q_hi = _q5_fifth_bits(high_bits_ptr + rows * stride_high_bits, row_valid, chunk, q_lo, q_hi)
            d = _per_row(scale_rows, chunk, row_valid)
            m = _per_row(mins_ptr + rows * stride_scales, chunk, row_valid)
            w_lo, w_hi = d * q_lo.to(tl.float32) + m, d * q_hi.to(tl.float32) + m
        elif FORMAT == Q4_0:
            d = _per_row(scale_rows, chunk, row_valid)  # a chunk is one block
            w_lo, w_hi = d * (q_lo - 8).to(tl.float32), d * (q_hi - 8).to(tl.float32)
        elif FORMAT == Q4_1:
            d = _per_row(scale_rows, chunk, row_valid)
            m = _per_row(mins_ptr + rows * stride_scales, chunk, row_valid)
            w_lo, w_hi = d * q_lo.to(tl.float32) + m, d * q_hi.to(tl.float32) + m
        else:
            d = _per_row(super_scales_ptr + rows * stride_super, lo // 256, row_valid)  # lo, hi: one super-block
            high_bit_rows = high_bits_ptr + rows[None, :] * stride_high_bits
            if FORMAT == Q6_K:
                w_lo, w_hi = _q6_k_weights(high_bit_rows, scale_rows, row_valid, lo, d, q_lo, q_hi)
            else:
                if FORMAT == Q5_K:
                    q_lo, q_hi = _q5_k_fifth_bits(high_bit_rows, valid, lo, q_lo, q_hi)
                dmin = _per_row(super_mins_ptr + rows * stride_super, lo // 256, row_valid)
                min_rows = mins_ptr + rows * stride_scales
                w_lo = _k_affine(scale_rows, min_rows, row_valid, lo // 32, d, dmin, q_lo)
                w_hi = _k_affine(scale_rows, min_rows, row_valid, hi // 32, d, dmin, q_hi)
    return lo, hi, w_lo, w_hi


@triton.jit
def run_of_16(start):
    """start, start + 1, ..., start + 15 for a start that is a multiple of 16, told to the compiler so that each
    row's run loads as whole vectors (it cannot see through the // and % that computed `start`)."""
    return tl.max_contiguous(tl.multiple_of(start + tl.arange(0, HALF), 16), 16)


@triton.jit
def _per_row(row_ptrs, index, row_valid):
    """Field `index` of each row (a scale, a min) as float32 [1, BLOCK_N]; `row_ptrs` point at each row's start."""
    return tl.load(row_ptrs + index, mask=row_valid, other=0).to(tl.float32)[None, :]


@triton.jit
def _q5_k_fifth_bits(high_bit_rows, valid, lo, q_lo, q_hi):
    """Bit s of qh[j] is the fifth bit of weight j of sub-block s; hi's sub-block is lo's + 1."""
    qh_index = run_of_16((lo // 256) * 32 + lo % 32)
    qh = tl.load(high_bit_rows + qh_index[:, None], mask=valid, other=0).to(tl.int32)
    shift = (lo % 256) // 32
    return q_lo | (((qh >> shift) & 1) << 4), q_hi | (((qh >> (shift + 1)) & 1) << 4)


@triton.jit
def _k_affine(scale_rows, min_rows, row_valid, sub_block, d, dmin, q):
    """Q4_K's and Q5_K's w = (d * sc) * q - dmin * m, with the sub-block's 6-bit scale and min."""
    sc = _per_row(scale_rows, sub_block, row_valid)
    m = _per_row(min_rows, sub_block, row_valid)
    return (d * sc) * q.to(tl.float32) - dmin * m


@triton.jit
def _q6_k_weights(high_bit_rows, scale_rows, row_valid, lo, d, low, high):
    """Q6_K's w = (d * scale) * (q - 32), a scale per 16 weights. lo is weight u < 64 of half h of its
    super-block: the top two bits of weight u + j are bits 2s, 2s + 1 (s = u // 32) of qh byte 32h + (u + j) % 32,
    those of hi + j (weight u + 64 + j of the same half) bits 2s + 4, 2s + 5 of that byte."""
    within = lo % 256
    qh_index = run_of_16((lo // 256) * 64 + (within // 128) * 32 + within % 32)
    qh = tl.load(high_bit_rows + qh_index[:, None], mask=row_valid[None, :], other=0).to(tl.int32)
    shift = ((within % 128) // 32) * 2
    q_lo = (low | (((qh >> shift) & 3) << 4)) - 32
    q_hi = (high | (((qh >> (shift + 4)) & 3) << 4)) - 32
    scale_lo = _per_row(scale_rows, lo // 16, row_valid)
    scale_hi = _per_row(scale_rows, (lo + 64) // 16, row_valid)
    return (d * scale_lo) * q_lo.to(tl.float32), (d * scale_hi) * q_hi.to(tl.float32)


@triton.jit
def _two_bit_first_byte(chunk):
    """The first quant byte of chunk `chunk` of Q2_K or Q3_K: a super-block's 8 chunks read its 4 runs of 16
    bytes twice each, fields 0 and 1 of their bytes, then fields 2 and 3."""
    return (chunk // 8) * 64 + ((chunk % 8) // 2) * 16


@triton.jit
def _two_bit_lo(chunk):
    """The weight of the first field's byte 0 in chunk `chunk` (hi: the next field's, 32 further). Run r of a
    super-block holds weights 128 (r // 2) + 16 (r % 2) + 32 s + j in field s of byte j."""
    run = (chunk % 8) // 2
    return (chunk // 8) * 256 + (run // 2) * 128 + (run % 2) * 16 + (chunk % 2) * 64


@triton.jit
def _byte_per_row(row_ptrs, index, row_valid):
    """Byte `index` of each row as int32 [1, BLOCK_N]."""
    return tl.load(row_ptrs + index, mask=row_valid, other=0).to(tl.int32)[None, :]


@triton.jit
def _q5_fifth_bits(qh_rows, row_valid, chunk, q_lo, q_hi):
    """Q5_0's and Q5_1's fifth bit of weight j of block `chunk`: bit j of its qh (int32 [N, K/32])."""
    qh = tl.load(qh_rows + chunk, mask=row_valid, other=0)[None, :]
    j = tl.arange(0, HALF)[:, None]
    return q_lo | (((qh >> j) & 1) << 4), q_hi | (((qh >> (j + 16)) & 1) << 4)


@triton.jit
def _q2_k_weights(scale_rows, row_valid, sub_block, d, dmin, q):
    """Q2_K's w = (d * sc) * q - dmin * m, sc and m the low and high nibbles of the sub-block's byte."""
    packed = _byte_per_row(scale_rows, sub_block, row_valid)
    return (d * (packed & 0x0F).to(tl.float32)) * q.to(tl.float32) - dmin * (packed >> 4).to(tl.float32)


@triton.jit
def _q3_k_values(high_bit_rows, valid, lo, q_lo, q_hi):
    """Q3_K's q - 4: weight 128h + 32s + l has its third bit in bit 4h + s of hmask byte l (l < 32)."""
    within = lo % 256
    hmask = tl.load(high_bit_rows + run_of_16((lo // 256) * 32 + within % 32)[:, None], mask=valid, other=0)
    bit = (within // 128) * 4 + (within % 128) // 32
    hmask = hmask.to(tl.int32)
    return (q_lo | (((hmask >> bit) & 1) << 2)) - 4, (q_hi | (((hmask >> (bit + 1)) & 1) << 2)) - 4


@triton.jit
def _q3_k_scale(scale_rows, row_valid, sub_block):
    """Q3_K's signed 6-bit scale i of a super-block (12 packed bytes each): its low nibble is nibble i // 8 of
    byte i % 8, its top two bits bits 2 (i // 4), 2 (i // 4) + 1 of byte 8 + i % 4; less 32."""
    packed_at, i = (sub_block // 16) * 12, sub_block % 16
    low = (_byte_per_row(scale_rows, packed_at + i % 8, row_valid) >> ((i // 8) * 4)) & 0x0F
    high = (_byte_per_row(scale_rows, packed_at + 8 + i % 4, row_valid) >> ((i // 4) * 2)) & 3
    return ((low | (high << 4)) - 32).to(tl.float32)
