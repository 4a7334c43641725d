"""A block-format weight repacked for the GPU: GGUF's bytes, with each block's scales split out of the quants.

A GGUF block interleaves fp16 scales with its quants (34, 18, 20, 144, 176 or 210 bytes), so its fields sit at
odd offsets and no load of them can be vectorised. `pack_for_device` moves the same bits into tensors of one
field each, row-major [out, ...], every row of quants a contiguous run (in_features is a multiple of 32):

    format  quants             high_bits          scales              mins                super-block d, dmin
    q8_0    int8 q [N, K]      -                  fp16 d [N, K/32]    -                   -
    q4_0    uint8 qs [N, K/2]  -                  fp16 d [N, K/32]    -                   -
    q4_1    uint8 qs [N, K/2]  -                  fp16 d [N, K/32]    fp16 m [N, K/32]    -
    q4_k    uint8 qs [N, K/2]  -                  uint8 sc [N, K/32]  uint8 m [N, K/32]   fp16 [N, K/256] each
    q5_k    uint8 qs [N, K/2]  uint8 qh [N, K/8]  uint8 sc [N, K/32]  uint8 m [N, K/32]   fp16 [N, K/256] each
    q6_k    uint8 ql [N, K/2]  uint8 qh [N, K/4]  int8 sc [N, K/16]   -                   fp16 d [N, K/256]
    q5_0    uint8 qs [N, K/2]  int32 qh [N, K/32] fp16 d [N, K/32]    -                   -
    q5_1    uint8 qs [N, K/2]  int32 qh [N, K/32] fp16 d [N, K/32]    fp16 m [N, K/32]    -
    q2_k    uint8 qs [N, K/4]  -                  uint8 sc [N, K/16]  -                   fp16 [N, K/256] each
    q3_k    uint8 qs [N, K/4]  uint8 hm [N, K/8]  uint8 sc [N, 12K/256]  -                fp16 d [N, K/256]

The quant bytes keep GGUF's order, so a byte still pairs two weights G apart (its low and its high nibble):
G = 16 for q4_0/q4_1 (a block's bytes), 32 for q4_k/q5_k (a sub-block pair), 64 for q6_k (half a
super-block's ql; q5_0/q5_1 take q4_0's and q4_1's). Q2_K's and Q3_K's bytes hold four 2-bit fields, weights
32 apart; their scales stay packed as stored (Q2_K's scale and min nibbles, Q3_K's 12 bytes of 6-bit scales),
unpacked by the kernel. The kernel (triton_dequant_tiles.py) multiplies the two nibbles' weights separately, by
activations gathered G apart, and never reorders them. The K-quants' 6-bit (scale, min) pairs are unpacked
to a byte each (16 bytes for 12), so a packed weight is at most 3% larger than the file's. Every value is
the file's: nothing is rounded.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from pagedserve.kernels.block_formats import FORMATS, QuantizedWeight
from pagedserve.kernels.quantized_reference import _scales_and_mins

# Weights a quant byte's two nibbles lie apart (see above); q8_0, one weight a byte, is read in halves of
# its blocks as if it paired weights 16 apart.
NIBBLE_PAIR_DISTANCE = {"q8_0": 16, "q4_0": 16, "q4_1": 16, "q4_k": 32, "q5_k": 32, "q6_k": 64}
NIBBLE_PAIR_DISTANCE |= {"q5_0": 16, "q5_1": 16, "q2_k": 32, "q3_k": 32}  # 2-bit fields: weights 32 apart


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors elementwise is not equality
class DeviceQuantizedWeight:
    """A linear layer's weight [out, in] in block format `qtype`, repacked as the module docstring lays out
    (fields a format does not use are None)."""

    qtype: str
    shape: tuple[int, int]
    quants: torch.Tensor
    scales: torch.Tensor
    high_bits: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    super_scales: torch.Tensor | None = None  # the K-quants' d
    super_mins: torch.Tensor | None = None  # Q4_K's and Q5_K's dmin

    @property
    def device(self) -> torch.device:
        return self.quants.device

    @property
    def nbytes(self) -> int:
        """Bytes of all fields: what one product reads from memory."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [value for f in fields(self) if isinstance(value := getattr(self, f.name), torch.Tensor)]


def pack_for_device(weight: QuantizedWeight, device: torch.device | str) -> DeviceQuantizedWeight:
    """`weight`'s blocks in the layout above, on `device` (the CPU weight is left as it is)."""
    rows, fmt = weight.shape[0], FORMATS[weight.qtype]
    grouped = weight.blocks.view(rows, -1, fmt.block_bytes)  # [rows, blocks, block_bytes]

    def field(start: int, end: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Bytes [start, end) of every block, as one row-major [rows, ...] tensor of `dtype` on the device."""
        return grouped[..., start:end].contiguous().view(dtype).reshape(rows, -1).to(device)

    qtype = weight.qtype
    if qtype == "q8_0":
        return DeviceQuantizedWeight(qtype, weight.shape, field(2, 34, torch.int8), field(0, 2, torch.float16))
    if qtype == "q4_0":
        return DeviceQuantizedWeight(qtype, weight.shape, field(2, 18), field(0, 2, torch.float16))
    if qtype == "q4_1":
        d, m = field(0, 2, torch.float16), field(2, 4, torch.float16)
        return DeviceQuantizedWeight(qtype, weight.shape, field(4, 20), d, mins=m)
    if qtype in ("q5_0", "q5_1"):
        qh = 2 if qtype == "q5_0" else 4  # after d (and m); a little-endian uint32, read as int32
        offsets = field(2, 4, torch.float16) if qtype == "q5_1" else None
        quants, d, high_bits = field(qh + 4, qh + 20), field(0, 2, torch.float16), field(qh, qh + 4, torch.int32)
        return DeviceQuantizedWeight(qtype, weight.shape, quants, d, high_bits, mins=offsets)
    if qtype == "q2_k":
        d, dmin = field(80, 82, torch.float16), field(82, 84, torch.float16)
        return DeviceQuantizedWeight(qtype, weight.shape, field(16, 80), field(0, 16), super_scales=d, super_mins=dmin)
    if qtype == "q3_k":
        return DeviceQuantizedWeight(
            qtype,
            weight.shape,
            field(32, 96),
            field(96, 108),
            field(0, 32),
            super_scales=field(108, 110, torch.float16),
        )
    if qtype == "q6_k":
        return DeviceQuantizedWeight(
            qtype,
            weight.shape,
            quants=field(0, 128),
            high_bits=field(128, 192),
            scales=field(192, 208, torch.int8),
            super_scales=field(208, 210, torch.float16),
        )
    scales, mins = _scales_and_mins(grouped[..., 4:16])  # q4_k and q5_k: uint8 [rows, blocks, 8] each
    return DeviceQuantizedWeight(
        qtype,
        weight.shape,
        quants=field(fmt.block_bytes - 128, fmt.block_bytes),
        high_bits=field(16, 48) if qtype == "q5_k" else None,
        scales=scales.reshape(rows, -1).contiguous().to(device),
        mins=mins.reshape(rows, -1).contiguous().to(device),
        super_scales=field(0, 2, torch.float16),
        super_mins=field(2, 4, torch.float16),
    )


# What a projection multiplies by: GGUF's blocks as they are (the CPU kernels), or repacked for the GPU.
AnyQuantizedWeight = QuantizedWeight | DeviceQuantizedWeight
