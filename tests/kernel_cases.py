"""Random paged-cache scenarios shared by the kernel tests of every backend, and where Triton's run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch


def triton_test_device(kernel: Any) -> str:
    """Where a Triton test module runs `kernel`: "cpu" when it and Triton's library are interpreted, "cuda" when
    both are compiled and there is a GPU; skips the module where triton was imported compiled without one."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    kernel_interpreted = isinstance(kernel, InterpretedFunction)
    library_interpreted = isinstance(triton.language.sum, InterpretedFunction)
    if kernel_interpreted and library_interpreted:
        return "cpu"
    if not kernel_interpreted and not library_interpreted and torch.cuda.is_available():
        return "cuda"
    pytest.skip("triton was imported uninterpreted earlier: run this file alone", allow_module_level=True)


@dataclass
class PagedCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # new keys [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], history already written
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    scale: float


def make_paged_case(
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> PagedCase:
    """Sequences whose first seq_len - query_len tokens are cached in shuffled blocks; the rest are new."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few unused blocks filled with garbage
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    used = 0
    slots = []
    for seq, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[seq, :n_blocks] = perm[used : used + n_blocks].int()
        used += n_blocks
        for pos in range(seq_len - query_lens[seq], seq_len):
            block = int(block_tables[seq, pos // block_size])
            slots.append(block * block_size + pos % block_size)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)

    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    return PagedCase(
        query=to(query),
        key=to(key),
        value=to(value),
        k_cache=to(k_cache),
        v_cache=to(v_cache),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        scale=head_dim**-0.5,
    )


# (seq_lens, query_lens): decode at 1 token, at a block boundary, just past it, over several blocks;
# a whole-prompt prefill; a chunk that starts mid-sequence next to decodes.
MIXED_BATCHES = [
    ([1], [1]),
    ([16], [1]),
    ([17], [1]),
    ([70, 33, 1], [1, 1, 1]),
    ([40], [40]),
    ([50, 17, 9, 64], [20, 1, 9, 1]),
]
