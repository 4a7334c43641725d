"""A linear layer's weight whose rows come in parts of different block formats.

A model fuses q/k/v (and gate/up) into one projection by stacking their rows; a GGUF file may store the parts
in different formats (a Q4_K_M file keeps some layers' v in Q6_K, their q and k in Q4_K). Rows of two formats
do not stack into one run of blocks, so the parts stay apart and multiply as separate products, each into its
own columns of one output.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pagedserve.kernels.device_blocks import AnyQuantizedWeight


@dataclass(frozen=True, eq=False)  # eq=False: the parts hold tensors
class RowStackedWeight:
    """Weight [sum of the parts' rows, in]: `parts` in order, each a block-format weight of its own."""

    parts: tuple[AnyQuantizedWeight, ...]

    def __post_init__(self) -> None:
        if not self.parts or len({part.shape[1] for part in self.parts}) != 1:
            raise ValueError(f"parts must share one input size, got {[part.shape for part in self.parts]}")

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def row_ranges(self) -> list[tuple[AnyQuantizedWeight, int, int]]:
        """Each part with the output columns [start, stop) its product fills."""
        stops = list(itertools.accumulate(part.shape[0] for part in self.parts))
        return [(part, stop - part.shape[0], stop) for part, stop in zip(self.parts, stops)]


# What a projection multiplies by when it is not float: one run of blocks, or parts of different formats.
ProjectionWeight = AnyQuantizedWeight | RowStackedWeight
