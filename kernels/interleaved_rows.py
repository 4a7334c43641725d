"""Q4_0 weights laid out for the CPU's 16-bit product: rows interleaved eight at a time (csrc/q4_0_rows8.c).

A layout, not a file format: the same bytes as the weight's Q4_0 rows, in the order where one vector holds a pair
of weights of each of eight rows, so that the product never sums across a vector's lanes and a block's eight
scales load as one (1.6x the speed of the row-at-a-time kernel at one token, 1.4x at 2-8; the C file has the
figures and the byte layout). Only csrc/int8_linear.c's 16-bit product reads it, for any number of tokens:
engine/worker/kernel_layouts.py lays a model's Q4_0 projections out so where the CPU multiplies them with int16
activations and AMX's tile unit (which reads the file's layout) does not take them. Everything else (the float32
path, embedding lookups, other devices) reads the file's layout.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from pagedserve.kernels.block_formats import QuantizedWeight
from pagedserve.kernels.cpu_native import bound_kernel, native_function

ROWS8 = "q4_0_r8"  # the layout's name as a QuantizedWeight's qtype (block_formats.KERNEL_LAYOUTS)
ROW_GROUP = 8  # rows interleaved together
Q4_0_BYTES = 18  # a Q4_0 block: fp16 d, 16 bytes of nibbles


def interleave_rows(weight: QuantizedWeight) -> QuantizedWeight:
    """A Q4_0 weight re-laid as ROWS8 (a new tensor of the same size; `weight` is left as it was)."""
    if weight.qtype != "q4_0" or weight.shape[0] % ROW_GROUP != 0:
        raise ValueError(f"only Q4_0 weights of a multiple of {ROW_GROUP} rows interleave, got {weight.qtype} "
                         f"{weight.shape}")  # fmt: skip
    interleave = _native_interleave()
    if interleave is None:
        blocks = interleave_reference(weight.blocks)
    else:
        blocks = torch.empty_like(weight.blocks)
        rows, row_bytes = weight.blocks.shape
        if interleave(blocks.data_ptr(), weight.blocks.data_ptr(), rows, row_bytes) != 0:
            raise ValueError(f"the kernel refused Q4_0 blocks of shape {tuple(weight.blocks.shape)}")
    return QuantizedWeight(ROWS8, blocks, weight.shape)


def interleave_reference(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 rows [rows, row_bytes] in the ROWS8 order, in torch: the oracle for the C interleave."""
    groups = _by_group(blocks)  # [G, 8 rows, B blocks, 18]
    scales = groups[..., :2].permute(0, 2, 1, 3)  # [G, B, 8 rows, 2]
    chunks = groups[..., 2:].unflatten(-1, (8, 2)).permute(0, 2, 3, 1, 4)  # [G, B, 8 chunks, 8 rows, 2]
    return torch.cat([scales.flatten(2), chunks.flatten(2)], dim=-1).reshape(blocks.shape).contiguous()


def deinterleave_rows(blocks: torch.Tensor) -> torch.Tensor:
    """ROWS8 blocks [rows, row_bytes] back in Q4_0's row order: how every other reader sees the weight."""
    rows, row_bytes = blocks.shape
    groups = blocks.reshape(rows // ROW_GROUP, row_bytes // Q4_0_BYTES, Q4_0_BYTES * ROW_GROUP)  # [G, B, 144]
    scales = groups[..., :16].unflatten(-1, (ROW_GROUP, 2))  # [G, B, 8 rows, 2]
    chunks = groups[..., 16:].unflatten(-1, (8, ROW_GROUP, 2)).transpose(2, 3).flatten(3)  # [G, B, 8 rows, 16]
    rows_first = torch.cat([scales, chunks], dim=-1).transpose(1, 2)  # [G, 8 rows, B, 18]
    return rows_first.reshape(rows, row_bytes).contiguous()


def rows8_kernel_built() -> bool:
    """Whether the library's ROWS8 product is the vector one (AVX2), the only build where the layout pays."""
    available = native_function("q4_0_rows8_available", [])
    return available is not None and bool(available())


@bound_kernel
def _native_interleave() -> Callable[..., int] | None:
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    return native_function("q4_0_rows8_interleave", [pointer, pointer, i64, i64])


def _by_group(blocks: torch.Tensor) -> torch.Tensor:
    rows, row_bytes = blocks.shape
    return blocks.reshape(rows // ROW_GROUP, ROW_GROUP, row_bytes // Q4_0_BYTES, Q4_0_BYTES)
