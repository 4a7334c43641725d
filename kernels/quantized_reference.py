"""The block formats in plain torch: `dequantize`, the oracle the kernels are tested against, and `quantize`.

`dequantize` computes bit for bit what gguf-py's dequantize computes. `quantize` rounds as ggml's reference
quantizers do for the 32-weight formats (bit for bit what gguf-py's quantize writes). gguf-py has no K-quant
quantizers; the ones here round each sub-block's range to nearest, without llama.cpp's search for the best
scales: valid blocks, a little less accurate than llama.cpp's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedserve.kernels.block_formats import FORMATS, SUPER_BLOCK, QuantizedWeight, block_format
from pagedserve.kernels.interleaved_rows import as_stored


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The weight as float32 [out, in]: the oracle the kernel is tested against."""
    return dequantize_rows(weight.blocks, weight.qtype)


def dequantize_rows(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """Rows of blocks [rows, row_bytes] as float32 [rows, in], computed as gguf-py does (same float32 ops in the
    same order), so that the two agree bit for bit. An interleaved layout as the rows of its format it holds."""
    blocks, qtype = as_stored(blocks, qtype)
    rows, fmt = blocks.shape[0], FORMATS[qtype]
    grouped = blocks.view(rows, -1, fmt.block_bytes)  # [rows, in / block_weights, block_bytes]
    if fmt.block_weights == SUPER_BLOCK:
        return _dequantize_super_blocks(grouped, qtype).view(rows, -1)
    d = _halves(grouped, 0)
    if qtype in ("q5_0", "q5_1"):
        return _dequantize_q5(grouped, qtype, d).view(rows, -1)
    if qtype == "q8_0":
        return (grouped[..., 2:].view(torch.int8).float() * d).view(rows, -1)
    nibbles = _nibbles(grouped[..., 4:] if qtype == "q4_1" else grouped[..., 2:])
    if qtype == "q4_0":
        return (d * (nibbles - 8)).view(rows, -1)
    return (d * nibbles + _halves(grouped, 2)).view(rows, -1)


def _halves(grouped: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of each block, as float32 [rows, blocks, 1]."""
    return grouped[..., offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """The 32 nibbles of each block's 16 bytes, in weight order (all low halves, then all high), as float32."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()


def _dequantize_super_blocks(grouped: torch.Tensor, qtype: str) -> torch.Tensor:
    """K-quant super-blocks [rows, n, block_bytes] as float32 [rows, n, sub-blocks, weights each], computed as
    gguf-py's Q4_K, Q5_K and Q6_K dequantize_blocks do."""
    if qtype in ("q2_k", "q3_k"):
        return _dequantize_q2_k(grouped) if qtype == "q2_k" else _dequantize_q3_k(grouped)
    if qtype == "q6_k":
        d = _halves(grouped, 208) * grouped[..., 192:208].view(torch.int8).float()  # [rows, n, 16]
        return d.unsqueeze(-1) * _q6_k_values(grouped[..., :128], grouped[..., 128:192])
    scales, mins = _scales_and_mins(grouped[..., 4:16])
    d = (_halves(grouped, 0) * scales.float()).unsqueeze(-1)  # [rows, n, 8, 1]
    dm = (_halves(grouped, 2) * mins.float()).unsqueeze(-1)
    q = _paired_nibbles(grouped[..., -128:])
    if qtype == "q5_k":
        q = q | (_bit_fields(grouped[..., 16:48], 1) << 4)
    return d * q.float() - dm


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins, uint8 [..., 8] each: bytes 0-3 hold scales 0-3 and
    bytes 4-7 mins 0-3 in their low 6 bits; bytes 8-11 hold scales 4-7 (low nibble) and mins 4-7 (high nibble)
    less their top 2 bits, which are the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    low_scales, low_mins, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([low_scales & 63, (rest & 0x0F) | ((low_scales >> 2) & 0x30)], dim=-1)
    mins = torch.cat([low_mins & 63, (rest >> 4) | ((low_mins >> 2) & 0x30)], dim=-1)
    return scales, mins


def _paired_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K's and Q5_K's 128 bytes [..., 128] as 8 sub-blocks of 32 nibbles, uint8 [..., 8, 32]: sub-blocks 2i
    and 2i + 1 are the low and high nibbles of bytes 32i..32i+31."""
    pairs = qs.unflatten(-1, (4, 32))
    return torch.stack([pairs & 0x0F, pairs >> 4], dim=-2).flatten(-3, -2)


def _bit_fields(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Each byte's fields of `width` bits, lowest first, along a new second-to-last dimension: uint8 [..., L]
    -> [..., 8 / width, L]."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8).unsqueeze(-1)
    return (packed.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _q6_k_values(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """Q6_K's q - 32 as float32 [..., 16, 16] from ql [..., 128] and qh [..., 64]: each half of 128 weights takes
    its 4 low bits from 64 bytes of ql (weights 0-63 the low nibbles, 64-127 the high ones) and its 2 high bits
    from 32 bytes of qh (weights 32s..32s+31 from bits 2s, 2s + 1)."""
    halves = ql.unflatten(-1, (2, 64))
    low = torch.stack([halves & 0x0F, halves >> 4], dim=-2).flatten(-3)
    high = _bit_fields(qh.unflatten(-1, (2, 32)), 2).flatten(-3)
    return ((low | (high << 4)).float() - 32).unflatten(-1, (16, 16))


def _dequantize_q5(grouped: torch.Tensor, qtype: str, d: torch.Tensor) -> torch.Tensor:
    """Q5_0's d * (q - 16) and Q5_1's d * q + m, q = nibble | (bit j of the uint32 qh) << 4, as gguf-py does."""
    qh_at = 4 if qtype == "q5_1" else 2
    high = _bit_fields(grouped[..., qh_at : qh_at + 4], 1).transpose(-1, -2).flatten(-2)  # bit j: weight j
    q = (torch.cat([grouped[..., qh_at + 4 :] & 0x0F, grouped[..., qh_at + 4 :] >> 4], dim=-1) | (high << 4)).float()
    return d * (q - 16) if qtype == "q5_0" else d * q + _halves(grouped, 2)


def _two_bit_values(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K's and Q3_K's 64 bytes of 2-bit fields [..., 64] as 16 sub-blocks of 16, uint8 [..., 16, 16]: each
    half of 128 weights owns 32 bytes, weights 32s..32s+31 of a half in bits 2s, 2s + 1 of them."""
    return _bit_fields(qs.unflatten(-1, (2, 32)), 2).flatten(-3).unflatten(-1, (16, 16))


def _dequantize_q2_k(grouped: torch.Tensor) -> torch.Tensor:
    """Q2_K: scales[16] (low nibble the sub-block's scale, high its min), qs[64], fp16 d, fp16 dmin."""
    scales = grouped[..., :16]
    dl = (_halves(grouped, 80) * (scales & 0x0F).float()).unsqueeze(-1)  # [rows, n, 16, 1]
    ml = (_halves(grouped, 82) * (scales >> 4).float()).unsqueeze(-1)
    return dl * _two_bit_values(grouped[..., 16:80]).float() - ml


def _dequantize_q3_k(grouped: torch.Tensor) -> torch.Tensor:
    """Q3_K: hmask[32], qs[64], 12 bytes of 6-bit scales, fp16 d; q = 2 low bits | hmask's bit << 2, less 4.
    Scale i's low nibble is nibble i // 8 of byte i % 8, its top 2 bits bits 2(i // 4) of byte 8 + i % 4."""
    packed = grouped[..., 96:108]
    low, high = _bit_fields(packed[..., :8], 4).flatten(-2), _bit_fields(packed[..., 8:], 2).flatten(-2)
    scales = ((low | (high << 4)).view(torch.int8) - 32).float()
    high_bits = _bit_fields(grouped[..., :32], 1).flatten(-2).unflatten(-1, (16, 16))  # weight 32m + l: bit m
    q = (_two_bit_values(grouped[..., 32:96]) | (high_bits << 2)).float() - 4
    return (_halves(grouped, 108) * scales).unsqueeze(-1) * q


# --- quantization (ggml's reference quantizers) -------------------------------------------------------------


def quantize(weight: torch.Tensor, qtype: str) -> QuantizedWeight:
    """A float32 weight [out, in] in format `qtype`, rounded to nearest (as ggml's reference quantizers, and
    gguf-py's, do for the 32-weight formats): for tests, and for quantizing a float checkpoint at load time."""
    fmt = block_format(qtype)
    quantizer = _QUANTIZERS[fmt.ggml_type]
    if weight.dim() != 2:
        raise ValueError(f"weight must be a matrix [out, in], got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    fmt.check_in_features(in_features)
    blocks = quantizer(weight.detach().to("cpu", torch.float32).reshape(-1, fmt.block_weights))
    return QuantizedWeight(qtype, blocks.reshape(out_features, -1).contiguous(), (out_features, in_features))


def _quantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """d = max |w| / 127, q = roundf(w / d): ggml's quantize_row_q8_0_ref."""
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = _round_half_away(blocks * _inverse(d)).to(torch.int8)
    return torch.cat([_half_bytes(d), q.view(torch.uint8)], dim=-1)


def _quantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """d = (the weight of largest magnitude) / -8, nibble = trunc(w / d + 8.5) capped at 15: ggml's
    quantize_row_q4_0_ref (the largest weight lands on nibble 0, exactly)."""
    largest = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
    d = largest / -8
    nibbles = torch.trunc(blocks * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_half_bytes(d), _pack(nibbles)], dim=-1)


def _quantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """m = min w, d = (max w - m) / 15, nibble = trunc((w - m) / d + 0.5) capped at 15: ggml's
    quantize_row_q4_1_ref."""
    low, high = blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)
    d = (high - low) / 15
    nibbles = torch.trunc((blocks - low) * _inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_half_bytes(d), _half_bytes(low), _pack(nibbles)], dim=-1)


def _quantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _quantize_k_affine(blocks, bits=4)


def _quantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    return _quantize_k_affine(blocks, bits=5)


def _quantize_k_affine(blocks: torch.Tensor, bits: int) -> torch.Tensor:
    """Q4_K and Q5_K: each sub-block of 32 spans [min(w, 0), max w] in 2^bits - 1 steps; steps and -mins are
    6-bit multiples of the super-block's d and dmin (fp16), q = round((w + dmin * m) / (d * sc))."""
    levels = (1 << bits) - 1
    groups = blocks.view(-1, 8, 32)
    low = groups.amin(dim=-1).clamp(max=0)  # as llama.cpp: a min above 0 would need a signed m
    d, scales = _multiples((groups.amax(dim=-1) - low) / levels, top=63)
    dmin, mins = _multiples(-low, top=63)
    group_d, group_min = (d * scales).unsqueeze(-1), (dmin * mins).unsqueeze(-1)
    q = torch.round((groups + group_min) * _inverse(group_d)).clamp(0, levels).to(torch.uint8)
    pairs = q.view(-1, 4, 2, 32) & 0x0F  # sub-blocks 2i and 2i + 1 share bytes 32i..32i+31
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).view(-1, 128)
    high = [] if bits == 4 else [_pack_bit_fields(q >> 4, 1)]
    return torch.cat([_half_bytes(d), _half_bytes(dmin), _pack_scales(scales, mins), *high, qs], dim=-1)


def _multiples(values: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative values [n, s] as d * multiples: d [n, 1] the largest / top rounded to fp16, the multiples
    uint8 [n, s] in 0..top (63 for 6-bit scales, 15 for 4-bit ones)."""
    d = (values.amax(dim=-1, keepdim=True) / top).to(torch.float16).float()
    return d, torch.round(values * _inverse(d)).clamp(0, top).to(torch.uint8)


def _pack_scales(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 8] scales and mins (6 bits) into the 12 bytes _scales_and_mins reads."""
    low_scales = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    low_mins = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    rest = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return torch.cat([low_scales, low_mins, rest], dim=-1)


def _pack_bit_fields(fields: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., 8 / width, L] fields of `width` bits into [..., L] bytes: _bit_fields' inverse."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8).unsqueeze(-1)
    return ((fields & ((1 << width) - 1)) << shifts).sum(dim=-2, dtype=torch.uint8)


def _quantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Each sub-block of 16 scaled so that its weight of largest magnitude lands on q = -32 (as Q4_0's does on
    nibble 0), its scale an int8 multiple of the super-block's d (fp16), q = round(w / (d * scale))."""
    groups = blocks.view(-1, 16, 16)
    steps = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True)).squeeze(-1) / -32
    d = (steps.abs().amax(dim=-1, keepdim=True) / 127).to(torch.float16).float()
    scales = torch.round(steps * _inverse(d)).clamp(-127, 127)
    group_d = (d * scales).unsqueeze(-1)
    q = (torch.round(groups * _inverse(group_d)).clamp(-32, 31) + 32).to(torch.uint8)  # [n, 16, 16]
    halves = q.view(-1, 2, 2, 64) & 0x0F  # weights 0-63 of a half in low nibbles, 64-127 in high ones
    ql = (halves[:, :, 0] | (halves[:, :, 1] << 4)).view(-1, 128)
    qh = _pack_bit_fields(q.view(-1, 2, 4, 32) >> 4, 2).view(-1, 64)
    return torch.cat([ql, qh, scales.to(torch.int8).view(torch.uint8), _half_bytes(d)], dim=-1)


def _quantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """d = (the weight of largest magnitude) / -16, q = trunc(w / d + 16.5) capped at 31: ggml's
    quantize_row_q5_0_ref."""
    largest = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
    d = largest / -16
    q = torch.trunc(blocks * _inverse(d) + 16.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([_half_bytes(d), _pack_fifth_bits(q), _pack(q & 0x0F)], dim=-1)


def _quantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """m = min w, d = (max w - m) / 31, q = trunc((w - m) / d + 0.5) capped at 31: ggml's quantize_row_q5_1_ref."""
    low, high = blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)
    d = (high - low) / 31
    q = torch.trunc((blocks - low) * _inverse(d) + 0.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([_half_bytes(d), _half_bytes(low), _pack_fifth_bits(q), _pack(q & 0x0F)], dim=-1)


def _pack_fifth_bits(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each of a block's 32 q [..., 32] as the 4 bytes of a little-endian uint32, weight j in bit j."""
    return _pack_bit_fields((q >> 4).unflatten(-1, (4, 8)).transpose(-1, -2), 1)


def _quantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """Each sub-block of 16 spans [min(w, 0), max w] in 3 steps; steps and -mins are 4-bit multiples of the
    super-block's d and dmin (fp16), q = round((w + dmin * m) / (d * sc))."""
    groups = blocks.view(-1, 16, 16)
    low = groups.amin(dim=-1).clamp(max=0)
    d, scales = _multiples((groups.amax(dim=-1) - low) / 3, top=15)
    dmin, mins = _multiples(-low, top=15)
    group_d, group_min = (d * scales).unsqueeze(-1), (dmin * mins).unsqueeze(-1)
    q = torch.round((groups + group_min) * _inverse(group_d)).clamp(0, 3).to(torch.uint8)
    qs = _pack_bit_fields(q.view(-1, 2, 4, 32), 2).view(-1, 64)
    return torch.cat([scales | (mins << 4), qs, _half_bytes(d), _half_bytes(dmin)], dim=-1)


def _quantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """Each sub-block of 16 scaled so that its weight of largest magnitude lands on q = -4 (as Q6_K's on -32),
    its scale a 6-bit signed multiple of the super-block's d (fp16), q = round(w / (d * scale))."""
    groups = blocks.view(-1, 16, 16)
    steps = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True)).squeeze(-1) / -4
    d = (steps.abs().amax(dim=-1, keepdim=True) / 31).to(torch.float16).float()
    scales = torch.round(steps * _inverse(d)).clamp(-32, 31)
    q = (torch.round(groups * _inverse((d * scales).unsqueeze(-1))).clamp(-4, 3) + 4).to(torch.uint8)
    hmask = _pack_bit_fields((q >> 2).view(-1, 8, 32), 1)
    qs = _pack_bit_fields(q.view(-1, 2, 4, 32) & 3, 2).view(-1, 64)
    biased = (scales + 32).to(torch.uint8)  # [n, 16], 6 bits each
    low = biased[:, :8] & 0x0F | (biased[:, 8:] & 0x0F) << 4
    high = _pack_bit_fields((biased >> 4).view(-1, 4, 4), 2)
    return torch.cat([hmask, qs, low, high, _half_bytes(d)], dim=-1)


_QUANTIZERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    FORMATS["q8_0"].ggml_type: _quantize_q8_0,
    FORMATS["q4_0"].ggml_type: _quantize_q4_0,
    FORMATS["q4_1"].ggml_type: _quantize_q4_1,
    FORMATS["q4_k"].ggml_type: _quantize_q4_k,
    FORMATS["q5_k"].ggml_type: _quantize_q5_k,
    FORMATS["q6_k"].ggml_type: _quantize_q6_k,
    FORMATS["q5_0"].ggml_type: _quantize_q5_0,
    FORMATS["q5_1"].ggml_type: _quantize_q5_1,
    FORMATS["q2_k"].ggml_type: _quantize_q2_k,
    FORMATS["q3_k"].ggml_type: _quantize_q3_k,
}


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0 (an all-zero block): its weights then quantize to the zero point."""
    return torch.where(d == 0, 0.0, 1 / d)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero, unlike torch.round), as gguf-py computes it: floor(|x| + 0.5) would
    round 0.49999997 up."""
    magnitude = x.abs()
    floored = magnitude.floor()
    return x.sign() * (floored + (2 * (magnitude - floored)).floor())


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    """float32 [..., 1] as the two little-endian bytes of its fp16 (round to nearest even, as numpy)."""
    return values.to(torch.float16).view(torch.uint8)


def _pack(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 32] nibbles into 16 bytes: weight j in the low half of byte j, weight j + 16 in its high half."""
    return nibbles[..., :16] | (nibbles[..., 16:] << 4)
