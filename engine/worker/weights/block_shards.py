"""A tensor-parallel rank's shard of a weight kept in a block format (kernels/block_formats.py).

Blocks run along each row's input features and never span rows. A column-parallel shard (q/k/v, gate/up, the
vocabulary-parallel head) is whole rows, so whole rows of blocks. A row-parallel shard (o_proj, down_proj) is
a slice of every row's input columns: a run of whole blocks only when the slice starts and ends on a block
boundary (32 weights; 256 for the K-quants), otherwise that projection cannot be split in its format.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.engine.worker.models.llama import CheckpointSlice
from pagedserve.kernels.quantized import QuantizedWeight, block_format


def on_block_boundaries(part: CheckpointSlice | None, qtype: str) -> bool:
    """Whether the shard `part` of a weight is whole blocks of `qtype` (rows always are)."""
    if part is None or part[0] == 0:
        return True
    weights = block_format(qtype).block_weights
    return part[1] % weights == 0 and part[2] % weights == 0


def read_shard(
    stored: np.ndarray,
    qtype: str,
    shape: tuple[int, int],
    part: CheckpointSlice | None = None,
    row_order: np.ndarray | None = None,
    num_rows: int | None = None,
) -> QuantizedWeight:
    """The shard `part` (None: all) of the weight of `shape` (out, in) whose blocks are `stored`, its rows of
    bytes [out, row_bytes]. Only the shard's bytes are read and copied: `stored` may be a memory map of the
    whole file. `row_order`: the stored row of each of the weight's rows (undoes a permutation); `num_rows`:
    rows the shard is padded to with zero bytes, which dequantize to zeros in every format (the last rank's
    share of a padded vocabulary)."""
    fmt = block_format(qtype)
    out_features, in_features = shape
    fmt.check_in_features(in_features)
    stored = stored.reshape(out_features, -1)  # a view: GGUF readers may keep blocks in a shape of their own
    if stored.dtype != np.uint8 or stored.shape[1] != fmt.row_bytes(in_features):
        raise ValueError(f"a {qtype} weight {shape} is rows of {fmt.row_bytes(in_features)} bytes, got {stored.shape}")
    rows = np.arange(out_features) if row_order is None else row_order
    columns = slice(None)
    if part is not None and part[0] == 0:
        rows = rows[part[1] : part[2]]
    elif part is not None:
        if not on_block_boundaries(part, qtype):
            raise ValueError(f"columns {part[1]}:{part[2]} of a {qtype} weight are not whole blocks")
        columns, in_features = slice(fmt.row_bytes(part[1]), fmt.row_bytes(part[2])), part[2] - part[1]
    data = np.ascontiguousarray(stored[rows, columns])  # advanced indexing: a copy of the shard's bytes only
    if num_rows is not None and num_rows > len(data):
        data = np.concatenate([data, np.zeros((num_rows - len(data), data.shape[1]), np.uint8)])
    return QuantizedWeight(qtype, torch.from_numpy(data), (len(data), in_features))
