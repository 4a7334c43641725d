"""Block weights laid out for the CPU's 16-bit product: rows interleaved eight at a time (csrc/q4_0_rows8.c,
csrc/q4_k_rows8.c and csrc/q6_k_rows8.c; csrc/rows8_layout.c writes them).

A layout, not a file format: the same bytes as the weight's rows, in the order where one vector holds a pair of
weights of each of eight rows, so that the product never sums across a vector's lanes and a block's eight scales
load as one (the C files have the byte layouts and the figures). Only csrc/int8_linear.c's 16-bit product reads
it, for any number of tokens: engine/worker/kernel_layouts.py lays a model's projections out so where the CPU
multiplies them with int16 activations. Everything else (the float32 path, embedding lookups, other devices)
reads the file's layout.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedserve.kernels.block_formats import QuantizedWeight, block_format
from pagedserve.kernels.cpu_native import native_function

ROW_GROUP = 8  # rows interleaved together
INTERLEAVED = {
    "q4_0": "q4_0_r8",
    "q4_k": "q4_k_r8",
    "q6_k": "q6_k_r8",
}  # a format -> its layout's name (block_formats.KERNEL_LAYOUTS)
STORED = {layout: qtype for qtype, layout in INTERLEAVED.items()}


def interleaves(weight: QuantizedWeight) -> bool:
    """Whether `weight` has an interleaved layout: a format that has one, in whole groups of rows."""
    return weight.qtype in INTERLEAVED and weight.shape[0] % ROW_GROUP == 0


def interleave_rows(weight: QuantizedWeight) -> QuantizedWeight:
    """`weight` re-laid with its rows interleaved (a new tensor of the same size; `weight` is left as it was)."""
    if not interleaves(weight):
        raise ValueError(f"only {'/'.join(INTERLEAVED)} weights of a multiple of {ROW_GROUP} rows interleave, got "
                         f"{weight.qtype} {weight.shape}")  # fmt: skip
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    interleave = native_function(f"{weight.qtype}_rows8_interleave", [pointer, pointer, i64, i64, ctypes.c_int])
    if interleave is None:
        blocks = interleave_reference(weight.blocks, weight.qtype)
    else:
        blocks = torch.empty_like(weight.blocks)
        rows, row_bytes = weight.blocks.shape
        if interleave(blocks.data_ptr(), weight.blocks.data_ptr(), rows, row_bytes, torch.get_num_threads()) != 0:
            raise ValueError(f"the kernel refused {weight.qtype} blocks of shape {tuple(weight.blocks.shape)}")
    return QuantizedWeight(INTERLEAVED[weight.qtype], blocks, weight.shape)


def interleave_reference(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """Rows [rows, row_bytes] of `qtype` in its interleaved order, in torch: the oracle for the C interleaves."""
    groups = _by_group(blocks, qtype)  # [G, 8 rows, B blocks, block bytes]
    fields = _FIELDS[qtype]
    parts = [groups[..., start:stop].unflatten(-1, (-1, width)).permute(0, 2, 3, 1, 4) for start, stop, width in fields]
    # each part [G, B, pieces, 8 rows, width]: piece i of every row, row 0 first
    return torch.cat([part.flatten(2) for part in parts], dim=-1).reshape(blocks.shape).contiguous()


def deinterleave_rows(blocks: torch.Tensor, layout: str) -> torch.Tensor:
    """Blocks [rows, row_bytes] in an interleaved layout back in its format's row order: how every other reader
    sees the weight."""
    qtype = STORED[layout]
    rows, row_bytes = blocks.shape
    block_bytes = block_format(qtype).block_bytes
    groups = blocks.reshape(rows // ROW_GROUP, row_bytes // block_bytes, block_bytes * ROW_GROUP)  # [G, B, 8 blocks]
    rows_first = torch.empty(rows // ROW_GROUP, ROW_GROUP, row_bytes // block_bytes, block_bytes, dtype=blocks.dtype)
    at = 0
    for start, stop, width in _FIELDS[qtype]:
        size = (stop - start) * ROW_GROUP
        pieces = groups[..., at : at + size].unflatten(-1, ((stop - start) // width, ROW_GROUP, width))
        rows_first[..., start:stop] = pieces.permute(0, 3, 1, 2, 4).flatten(3)  # [G, 8 rows, B, stop - start]
        at += size
    return rows_first.reshape(rows, row_bytes).contiguous()


def stored_rows(blocks: torch.Tensor, layout: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of blocks in an interleaved layout, in its format's row order: one gather of their bytes
    (an embedding lookup in a tied head's table: deinterleaving their groups whole costs 10-100x as much)."""
    row_bytes = blocks.shape[1]
    byte_of_row = _row_order(layout, row_bytes).view(ROW_GROUP, row_bytes)
    in_group = ids % ROW_GROUP
    group_start = (ids - in_group) * row_bytes  # the group's first byte
    return torch.take(blocks, byte_of_row.index_select(0, in_group) + group_start.unsqueeze(1))


@functools.cache
def _row_order(layout: str, row_bytes: int) -> torch.Tensor:
    """For each byte of a group's rows in order, its position in the interleaved group: the inverse of where
    interleave_reference (the oracle) puts them."""
    in_order = torch.arange(ROW_GROUP * row_bytes).reshape(ROW_GROUP, row_bytes)
    return interleave_reference(in_order, STORED[layout]).flatten().argsort()


def as_stored(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, str]:
    """(blocks, qtype) in the file's layout: an interleaved layout's rows put back in order, any format as it is."""
    return (deinterleave_rows(blocks, qtype), STORED[qtype]) if qtype in STORED else (blocks, qtype)


def rows8_kernel_built() -> bool:
    """Whether the library's interleaved products are the vector ones (AVX2), the only build where layouts pay."""
    available = native_function("rows8_available", [])
    return available is not None and bool(available())


# A block's fields in the order the layout stores them, each as (start, stop, width): the eight rows' pieces of
# `width` bytes of bytes [start, stop) follow one another, piece by piece (csrc/rows8_layout.c's table).
_FIELDS: dict[str, list[tuple[int, int, int]]] = {
    "q4_0": [(0, 2, 2), (2, 18, 2)],  # d; the 16 bytes of nibbles two at a time
    "q4_k": [(0, 2, 2), (2, 4, 2), (4, 16, 4), *((16 + 32 * j, 48 + 32 * j, 2) for j in range(4))],
    "q6_k": [
        (208, 210, 2),
        (192, 208, 1),
        (0, 32, 2),
        (32, 64, 2),
        (128, 160, 2),
        (64, 96, 2),
        (96, 128, 2),
        (160, 192, 2),
    ],
}


def _by_group(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    rows, row_bytes = blocks.shape
    block_bytes = block_format(qtype).block_bytes
    return blocks.reshape(rows // ROW_GROUP, ROW_GROUP, row_bytes // block_bytes, block_bytes)
