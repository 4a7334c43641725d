"""What every attention layer of one engine step needs to know about the batch."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """The packed batch of one step, in the shapes of the kernel contract.

    Device tensors feed the kernels; the host-side lists let a backend plan its launch (grid sizes,
    per-sequence splits) without reading device memory back.
    """

    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, all tokens of a sequence including the new ones
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, offsets of each sequence's new tokens
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token, < 0 = skip
    block_size: int
    query_lens_host: list[int]
    seq_lens_host: list[int]
    plan: Any = field(default=None, repr=False)  # backend-specific, filled by KernelBackend.prepare
    # With several KV cache groups (layers with block tables of their own: a model's sliding-window layers), the
    # metadata of each, this one first; the layers of group g read groups[g]. Empty with one group.
    groups: list[AttentionMetadata] = field(default_factory=list, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens_host)

    @classmethod
    def from_tensors(
        cls,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
        slot_mapping: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """Builds metadata from device tensors alone (reads them back: for tests and one-off calls)."""
        starts = query_start_loc.tolist()
        num_tokens = starts[-1]
        if slot_mapping is None:
            slot_mapping = torch.full((num_tokens,), -1, dtype=torch.long, device=seq_lens.device)
        return cls(
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            slot_mapping=slot_mapping,
            block_size=block_size,
            query_lens_host=[b - a for a, b in itertools.pairwise(starts)],
            seq_lens_host=seq_lens.tolist(),
        )
