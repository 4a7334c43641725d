"""x @ W^T with W kept in ggml's block formats (Q8_0, Q4_0, Q4_1 and the K-quants Q4_K, Q5_K, Q6_K: as GGUF
files store it), for the CPU.

A decode step of one sequence reads every weight once: on the CPU it is bound by memory bandwidth, and
these formats are 3.8-7.1x smaller than float32. `quantized_linear` multiplies float32 activations by the
weight as stored: for up to MAX_TOKENS tokens with the kernels in csrc/quantized_linear.c and
csrc/kquant_linear.c, which dequantize each block in registers as it streams past; for more (prefill, where the
product is bound by arithmetic, not by bytes) by dequantizing ROW_TILE rows at a time into a float32 matmul, so
no float32 copy of the whole weight ever exists.

Formats (blocks of BLOCK = 32 weights along the input dimension; a row is in/32 consecutive blocks):
    q8_0, 34 bytes: fp16 d, int8 q[32];                 w = d * q
    q4_0, 18 bytes: fp16 d, uint8 qs[16];               w = d * (nibble - 8)
    q4_1, 20 bytes: fp16 d, fp16 m, uint8 qs[16];       w = d * nibble + m
where weight j < 16 is the low nibble of qs[j] and weight j + 16 its high nibble. K-quants (super-blocks of
SUPER_BLOCK = 256 weights, sub-blocks with scales of their own; csrc/kquant_linear.c details the bit layouts):
    q4_k, 144 bytes: fp16 d, fp16 dmin, 8 6-bit (scale, min) pairs, 4-bit q;     w = d * sc * q - dmin * m
    q5_k, 176 bytes: as q4_k with a fifth bit of q from qh[32]
    q6_k, 210 bytes: 6-bit q, int8 scales[16] (one per 16 weights), fp16 d;      w = d * scale * (q - 32)

`dequantize` is the oracle: plain torch, bit for bit what gguf-py's dequantize computes. `quantize` rounds as
ggml's reference quantizers do for the 32-weight formats (bit for bit what gguf-py's quantize writes). gguf-py
has no K-quant quantizers; the ones here round each sub-block's range to nearest, without llama.cpp's search for
the best scales: valid blocks, a little less accurate than llama.cpp's.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedserve.kernels.cpu_native import native_function

BLOCK = 32  # weights per block of q8_0, q4_0 and q4_1
SUPER_BLOCK = 256  # weights per super-block of the K-quants
# Token counts the kernel takes; past them dequantizing tiles into a float32 matmul is faster. Measured with
# benchmarks/quantized_linear.py (its last table; Q4_1 gate/up and down shapes, 2 cores, AVX2): the kernel
# 1.9-2.2x as fast at 16 tokens, 1.3-1.4x at 32, 1.0-1.2x at 48, 0.9-1.1x at 64, 0.6-0.85x at 96-128.
MAX_TOKENS = 48
ROW_TILE = 256  # rows dequantized at a time past MAX_TOKENS: a 256 x 1536 float32 tile is 1.5 MiB


@dataclass(frozen=True)
class BlockFormat:
    """One of ggml's block formats: its type id (as GGUF numbers tensor types), a block's size in bytes and the
    weights one block holds (a row's input size must be a multiple of it)."""

    ggml_type: int
    block_bytes: int
    block_weights: int = BLOCK

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block_weights * self.block_bytes

    def check_in_features(self, in_features: int) -> None:
        if in_features <= 0 or in_features % self.block_weights != 0:
            raise ValueError(
                f"in_features must be a positive multiple of the {self.block_weights}-weight block, got {in_features}"
            )


FORMATS: dict[str, BlockFormat] = {
    "q8_0": BlockFormat(ggml_type=8, block_bytes=34),
    "q4_0": BlockFormat(ggml_type=2, block_bytes=18),
    "q4_1": BlockFormat(ggml_type=3, block_bytes=20),
    "q4_k": BlockFormat(ggml_type=12, block_bytes=144, block_weights=SUPER_BLOCK),
    "q5_k": BlockFormat(ggml_type=13, block_bytes=176, block_weights=SUPER_BLOCK),
    "q6_k": BlockFormat(ggml_type=14, block_bytes=210, block_weights=SUPER_BLOCK),
}


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors elementwise is not equality
class QuantizedWeight:
    """A linear layer's weight [out, in] as ggml blocks: `blocks` is uint8 [out, in / block_weights *
    block_bytes]."""

    qtype: str
    blocks: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        out_features, in_features = self.shape
        fmt = block_format(self.qtype)
        fmt.check_in_features(in_features)
        expected = (out_features, fmt.row_bytes(in_features))
        if self.blocks.dtype != torch.uint8 or self.blocks.device.type != "cpu" or not self.blocks.is_contiguous():
            got = f"{self.blocks.dtype} {self.blocks.device}"
            raise ValueError(f"blocks must be a contiguous CPU uint8 tensor, got {got}")
        if tuple(self.blocks.shape) != expected:
            raise ValueError(
                f"a {self.qtype} weight [{out_features}, {in_features}] is {expected[0]} rows of {expected[1]} bytes, "
                f"got blocks of shape {tuple(self.blocks.shape)}"
            )

    @classmethod
    def from_gguf(cls, raw: np.ndarray | torch.Tensor, qtype: str | int, shape: tuple[int, int]) -> QuantizedWeight:
        """The weight in a GGUF tensor's bytes (GGUFReader's `tensor.data`, any shape), of ggml type `qtype` (a
        name, or the type id a GGMLQuantizationType is), `shape` (out, in): GGUF lists a tensor's dimensions
        innermost first, so this is reversed(tensor.shape).

        The bytes are copied: a reader's arrays are read-only views of its memory map, which torch would share
        only with a warning that writing to them is undefined.
        """
        name = qtype if isinstance(qtype, str) else _name_of_type(int(qtype))
        data = raw.detach().cpu().numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
        if data.dtype != np.uint8:
            raise ValueError(f"raw must hold the tensor's bytes as uint8, got {data.dtype}")
        out_features, in_features = int(shape[0]), int(shape[1])  # GGUFReader's dimensions are numpy integers
        fmt = block_format(name)
        fmt.check_in_features(in_features)
        row_bytes = fmt.row_bytes(in_features)
        if data.size != out_features * row_bytes:
            expected = out_features * row_bytes
            raise ValueError(f"a {name} weight [{out_features}, {in_features}] takes {expected} bytes, got {data.size}")
        blocks = torch.from_numpy(np.array(data, copy=True).reshape(out_features, row_bytes))
        return cls(name, blocks, (out_features, in_features))

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks: what one product reads from memory (float32 would read 4 * out * in)."""
        return self.blocks.numel()


def block_format(qtype: str) -> BlockFormat:
    """The format named `qtype`; ValueError for a name this module does not know."""
    if qtype not in FORMATS:
        raise ValueError(f"unknown quantization type {qtype!r}: expected one of {', '.join(FORMATS)}")
    return FORMATS[qtype]


def _name_of_type(ggml_type: int) -> str:
    """The name of the format ggml numbers `ggml_type`; ValueError for a type this module does not read."""
    for name, fmt in FORMATS.items():
        if fmt.ggml_type == ggml_type:
            return name
    known = ", ".join(f"{name} ({fmt.ggml_type})" for name, fmt in FORMATS.items())
    raise ValueError(f"ggml type {ggml_type} is not one of {known}")


# --- the torch reference ------------------------------------------------------------------------------------


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The weight as float32 [out, in]: the oracle the kernel is tested against."""
    return _dequantize_rows(weight.blocks, weight.qtype)


def _dequantize_rows(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """Rows of blocks [rows, row_bytes] as float32 [rows, in], computed as gguf-py does (same float32 ops in the
    same order), so that the two agree bit for bit."""
    rows, fmt = blocks.shape[0], FORMATS[qtype]
    grouped = blocks.view(rows, -1, fmt.block_bytes)  # [rows, in / block_weights, block_bytes]
    if fmt.block_weights == SUPER_BLOCK:
        return _dequantize_super_blocks(grouped, qtype).view(rows, -1)
    d = _halves(grouped, 0)
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
    d, scales = _six_bit_multiples((groups.amax(dim=-1) - low) / levels)
    dmin, mins = _six_bit_multiples(-low)
    group_d, group_min = (d * scales).unsqueeze(-1), (dmin * mins).unsqueeze(-1)
    q = torch.round((groups + group_min) * _inverse(group_d)).clamp(0, levels).to(torch.uint8)
    pairs = q.view(-1, 4, 2, 32) & 0x0F  # sub-blocks 2i and 2i + 1 share bytes 32i..32i+31
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).view(-1, 128)
    high = [] if bits == 4 else [_pack_bit_fields(q >> 4, 1)]
    return torch.cat([_half_bytes(d), _half_bytes(dmin), _pack_scales(scales, mins), *high, qs], dim=-1)


def _six_bit_multiples(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative values [n, 8] as d * multiples: d [n, 1] the largest / 63 rounded to fp16, the multiples
    uint8 [n, 8] in 0..63."""
    d = (values.amax(dim=-1, keepdim=True) / 63).to(torch.float16).float()
    return d, torch.round(values * _inverse(d)).clamp(0, 63).to(torch.uint8)


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


_QUANTIZERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    FORMATS["q8_0"].ggml_type: _quantize_q8_0,
    FORMATS["q4_0"].ggml_type: _quantize_q4_0,
    FORMATS["q4_1"].ggml_type: _quantize_q4_1,
    FORMATS["q4_k"].ggml_type: _quantize_q4_k,
    FORMATS["q5_k"].ggml_type: _quantize_q5_k,
    FORMATS["q6_k"].ggml_type: _quantize_q6_k,
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


# --- the product ----------------------------------------------------------------------------------------------


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, in] @ W^T + bias -> [T, out], float32, on the CPU.

    x may be token-major or feature-major (a transposed view); the kernel reads it token-major, copying a
    feature-major x of more than one token. `out` (float32 [T, out], either layout) receives the result where
    given, so a caller may ask for the feature-major layout; otherwise a new token-major tensor does.
    """
    _check_operands(x, weight, bias, out)
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0])
    kernel = quantized_linear_kernel()
    if kernel is not None and x.shape[0] <= MAX_TOKENS and not x.requires_grad:
        return kernel(x, weight, bias, out)
    return tiled_linear(x, weight, bias, out)


def lookup_rows(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of the weight as float32 [T, in]: an embedding lookup in a table kept as blocks, equal to
    indexing the dequantized table."""
    rows = weight.blocks.index_select(0, ids.to("cpu", torch.long))
    return (dequantize_kernel() or _dequantize_rows)(rows, weight.qtype)


def tiled_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """quantized_linear's path past MAX_TOKENS, and without the native kernel: float32 matmuls of ROW_TILE
    dequantized rows at a time. Many tokens share each dequantized tile, and only one tile exists at a time."""
    dequantize_rows = dequantize_kernel() or _dequantize_rows
    for start in range(0, weight.shape[0], ROW_TILE):
        end = min(start + ROW_TILE, weight.shape[0])
        tile = dequantize_rows(weight.blocks[start:end], weight.qtype)
        out[:, start:end] = torch.nn.functional.linear(x, tile, None if bias is None else bias[start:end])
    return out


def _check_operands(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, out: torch.Tensor | None
) -> None:
    """The kernel trusts its pointers: refuse anything it would misread."""
    out_features, in_features = weight.shape
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [tokens, {in_features}], got shape {tuple(x.shape)}")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU tensor, got {x.dtype} {x.device}")
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.float32 or bias.device.type != "cpu"):
        raise ValueError(f"bias must be a float32 CPU [{out_features}] vector, got {bias.dtype} {tuple(bias.shape)}")
    if out is not None and (out.shape != (x.shape[0], out_features) or out.dtype != torch.float32):
        raise ValueError(f"out must be float32 [{x.shape[0]}, {out_features}], got {out.dtype} {tuple(out.shape)}")
    if out is not None and (out.device.type != "cpu" or 1 not in out.stride()):
        raise ValueError(f"out must be a CPU tensor with one of its strides 1, got strides {out.stride()}")


QuantizedLinear = Callable[[torch.Tensor, QuantizedWeight, torch.Tensor | None, torch.Tensor], torch.Tensor]


NativeFunctions = dict[int, Callable[..., int]]  # a block's weights (BLOCK, SUPER_BLOCK) -> the C function for it


@functools.cache
def quantized_linear_kernel() -> QuantizedLinear | None:
    """The kernels bound to the compiled library (csrc/quantized_linear.c's for 32-weight blocks,
    csrc/kquant_linear.c's for K-quants), or None where it cannot be built."""
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    argtypes = [pointer, i64, i64, pointer, i64, pointer, pointer, i64, i64, i64, i32, i32]
    functions = _native_functions({BLOCK: "quantized_linear_f32", SUPER_BLOCK: "kquant_linear_f32"}, argtypes)
    return None if functions is None else functools.partial(_native_linear, functions)


@functools.cache
def dequantize_kernel() -> Callable[[torch.Tensor, str], torch.Tensor] | None:
    """The C dequantization of rows of blocks (what `_dequantize_rows` computes, ~40x faster), or None where
    the library cannot be built."""
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    symbols = {BLOCK: "dequantize_f32", SUPER_BLOCK: "kquant_dequantize_f32"}
    functions = _native_functions(symbols, [pointer, pointer, i64, i64, i32, i32])
    return None if functions is None else functools.partial(_native_dequantize, functions)


def _native_functions(symbols: dict[int, str], argtypes: list[Any]) -> NativeFunctions | None:
    """The library's function named for each block size, or None where the library cannot be built."""
    bound = {weights: native_function(symbol, argtypes) for weights, symbol in symbols.items()}
    functions = {weights: function for weights, function in bound.items() if function is not None}
    return functions if len(functions) == len(symbols) else None


def _native_dequantize(functions: NativeFunctions, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """Contiguous rows of blocks [rows, row_bytes] as float32 [rows, in]."""
    fmt = FORMATS[qtype]
    rows, in_features = blocks.shape[0], blocks.shape[1] // fmt.block_bytes * fmt.block_weights
    out = torch.empty(rows, in_features)
    function = functions[fmt.block_weights]
    status = function(out.data_ptr(), blocks.data_ptr(), rows, in_features, fmt.ggml_type, torch.get_num_threads())
    if status != 0:
        raise ValueError(f"dequantize: the kernel refused {qtype} blocks of shape {tuple(blocks.shape)}")
    return out


def _native_linear(
    functions: NativeFunctions,
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """out [T, out] = x [T, in] @ W^T + bias with the C kernel; arguments already checked."""
    if x.stride(1) != 1:
        x = x.contiguous()  # feature-major: the kernel reads each token's features as one run
    if bias is not None:
        bias = bias.contiguous()
    out_features, in_features = weight.shape
    fmt = FORMATS[weight.qtype]
    status = functions[fmt.block_weights](
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        x.data_ptr(),
        x.stride(0),
        weight.blocks.data_ptr(),
        None if bias is None else bias.data_ptr(),
        x.shape[0],
        out_features,
        in_features,
        fmt.ggml_type,
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError("quantized_linear: scratch allocation failed")
    if status != 0:
        raise ValueError(f"quantized_linear: the kernel refused a {weight.qtype} weight of shape {weight.shape}")
    return out
