"""ggml's block formats (as GGUF files store weights) and a linear layer's weight kept in one of them.

Formats of 32-weight blocks along the input dimension (a row is in/32 consecutive blocks):
    q8_0, 34 bytes: fp16 d, int8 q[32];                 w = d * q
    q4_0, 18 bytes: fp16 d, uint8 qs[16];               w = d * (nibble - 8)
    q4_1, 20 bytes: fp16 d, fp16 m, uint8 qs[16];       w = d * nibble + m
    q5_0, 22 bytes: fp16 d, uint8 qh[4], uint8 qs[16];  w = d * (q - 16)
    q5_1, 24 bytes: fp16 d, fp16 m, qh[4], qs[16];      w = d * q + m
where weight j < 16 is the low nibble of qs[j] and weight j + 16 its high nibble; q5's fifth bit of weight j
is bit j of qh (a little-endian uint32). K-quants (super-blocks of SUPER_BLOCK = 256 weights, sub-blocks with
scales of their own; csrc/kquant_linear.c details the bit layouts):
    q4_k, 144 bytes: fp16 d, fp16 dmin, 8 6-bit (scale, min) pairs, 4-bit q;     w = d * sc * q - dmin * m
    q5_k, 176 bytes: as q4_k with a fifth bit of q from qh[32]
    q6_k, 210 bytes: 6-bit q, int8 scales[16] (one per 16 weights), fp16 d;      w = d * scale * (q - 32)
    q2_k, 84 bytes: 4-bit (scale, min) pairs per 16 weights, 2-bit q, fp16 d, dmin;  w = d * sc * q - dmin * m
    q3_k, 110 bytes: 3-bit q (high bits in hmask[32]), 6-bit scales per 16, fp16 d;  w = d * (sc - 32) * (q - 4)
(csrc/kquant_low_bits.c details the last two).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # weights per block of q8_0, q4_0, q4_1, q5_0 and q5_1
SUPER_BLOCK = 256  # weights per super-block of the K-quants


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
    "q5_0": BlockFormat(ggml_type=6, block_bytes=22),
    "q5_1": BlockFormat(ggml_type=7, block_bytes=24),
    "q4_k": BlockFormat(ggml_type=12, block_bytes=144, block_weights=SUPER_BLOCK),
    "q5_k": BlockFormat(ggml_type=13, block_bytes=176, block_weights=SUPER_BLOCK),
    "q6_k": BlockFormat(ggml_type=14, block_bytes=210, block_weights=SUPER_BLOCK),
    "q2_k": BlockFormat(ggml_type=10, block_bytes=84, block_weights=SUPER_BLOCK),
    "q3_k": BlockFormat(ggml_type=11, block_bytes=110, block_weights=SUPER_BLOCK),
}


# Layouts a CPU kernel re-lays a format into once loaded (kernels/interleaved_rows.py): no file stores them, so
# they are not FORMATS (what a file or `quantization` may name); type ids past ggml's.
KERNEL_LAYOUTS: dict[str, BlockFormat] = {
    "q4_0_r8": BlockFormat(ggml_type=1002, block_bytes=18),  # Q4_0, rows interleaved eight at a time
    "q4_k_r8": BlockFormat(ggml_type=1012, block_bytes=144, block_weights=SUPER_BLOCK),  # Q4_K, the same
    "q6_k_r8": BlockFormat(ggml_type=1014, block_bytes=210, block_weights=SUPER_BLOCK),  # Q6_K, the same
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
    """The format (or kernel layout) named `qtype`; ValueError for a name this module does not know."""
    if qtype in KERNEL_LAYOUTS:
        return KERNEL_LAYOUTS[qtype]
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
