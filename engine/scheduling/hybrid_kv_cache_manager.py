"""Block tables for a model with sliding-window layers among global ones (Gemma 2 and 3): one per KV cache group.

Group 0, the global layers, is KVCacheManager's own table; each windowed group (windowed_blocks.py) keeps a table
that gives blocks back once they fall out of its window. All groups allocate from one pool, so an allocation
succeeds in every group or in none, and the KV budget counts the blocks of them all.

A prefix-cache hit must hold in every group: the global group's chain of cached blocks from the start, cut to the
longest length after which each windowed group still has its window's blocks cached.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.engine.scheduling.block_pool import KVBlock
from pagedserve.engine.scheduling.kv_cache_manager import KVCacheManager
from pagedserve.engine.scheduling.request import Request
from pagedserve.engine.scheduling.windowed_blocks import WindowedBlocks


class HybridKVCacheManager(KVCacheManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        windows: Sequence[int],
        enable_caching: bool = True,
        extra_key: bytes = b"",
        long_rope_threshold: int | None = None,
    ) -> None:
        """`windows`: the sliding window of each group after the first (the global one)."""
        super().__init__(num_blocks, block_size, enable_caching, extra_key, long_rope_threshold)
        self.windowed = [
            WindowedBlocks(self.pool, block_size, window, bytes([group])) for group, window in enumerate(windows, 1)
        ]

    @property
    def num_groups(self) -> int:
        return 1 + len(self.windowed)

    def block_ids_by_group(self, request_id: str) -> list[list[int]]:
        return [self.block_ids(request_id), *(group.block_ids(request_id) for group in self.windowed)]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        hits, _ = super().get_computed_blocks(request)
        num_blocks = len(hits)
        while True:  # each group's hit is at most the length asked for: shrink until every group agrees
            agreed = min(group.longest_hit(request, num_blocks) for group in self.windowed)
            if agreed == num_blocks:
                break
            num_blocks = agreed
        self.prefix_hits -= (len(hits) - num_blocks) * self.block_size
        return hits[:num_blocks], num_blocks * self.block_size

    def _other_groups_need(self, request: Request, first_new: int, num_tokens: int, num_hits: int) -> int:
        return sum(group.need(request, first_new, num_tokens, num_hits) for group in self.windowed)

    def _take_other_groups_hits(self, request: Request, num_hits: int) -> None:
        if num_hits:
            for group in self.windowed:
                group.take_hits(request, num_hits)

    def _allocate_other_groups(self, request: Request, first_new: int, num_tokens: int) -> None:
        for group in self.windowed:
            self.pending_copies.extend(group.allocate(request, first_new, num_tokens))

    def fork(self, parent: Request, child: Request) -> None:
        super().fork(parent, child)
        for group in self.windowed:
            group.fork(parent.request_id, child.request_id)

    def free(self, request: Request) -> None:
        super().free(request)
        for group in self.windowed:
            group.free(request.request_id)

    def trim(self, request: Request, num_tokens: int) -> None:
        super().trim(request, num_tokens)
        for group in self.windowed:
            group.trim(request.request_id, num_tokens)


def kv_cache_manager(
    num_blocks: int,
    block_size: int,
    group_windows: Sequence[int | None],
    enable_caching: bool = True,
    extra_key: bytes = b"",
    long_rope_threshold: int | None = None,
) -> KVCacheManager:
    """The block manager for these KV cache groups (their windows, the global group's None first)."""
    if len(group_windows) == 1:
        return KVCacheManager(num_blocks, block_size, enable_caching, extra_key, long_rope_threshold)
    first, *windows = group_windows
    assert first is None and all(w is not None for w in windows), "the global group first, then windowed ones"
    return HybridKVCacheManager(
        num_blocks, block_size, [w for w in windows if w is not None], enable_caching, extra_key, long_rope_threshold
    )
