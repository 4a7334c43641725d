"""Physical KV blocks: a free queue with O(1) removal, ref counts, and the prefix-cache index.

A block whose ref count drops to zero goes to the tail of the free queue but keeps its contents and its
hash, so a later request with the same prefix can take it back (a cache hit) until the pool hands it out
again. Allocation pops from the head, so the least recently freed blocks are evicted first.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Prefix-cache identity, set while the block is registered as a full cached block.
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    parent_link: tuple[int, int] | None = None  # (parent block id, parent epoch): verifies the chain
    epoch: int = 0  # bumped each time the block is registered, so stale links never match
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)

    @property
    def link(self) -> tuple[int, int]:
        return (self.block_id, self.epoch)


class FreeBlockQueue:
    """Doubly linked list of free blocks: popleft, append and remove in O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.size = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None and block.next_free is None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.size += 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise IndexError("no free block")
        self.remove(first)
        return first

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.size -= 1

    def __iter__(self):
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[bytes, KVBlock] = {}
        self._epochs = itertools.count(1)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now, cached-but-unreferenced ones included."""
        return self.free_queue.size

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, count: int) -> list[KVBlock]:
        if count > self.free_queue.size:
            raise RuntimeError(f"asked for {count} blocks, {self.free_queue.size} free")
        taken = [self.free_queue.popleft() for _ in range(count)]
        for block in taken:
            self._evict(block)
            block.ref_cnt = 1
        return taken

    def take_cached(self, blocks: Iterable[KVBlock]) -> None:
        """Adds a reference to prefix-cache hits, pulling unreferenced ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference from each block; pass them tail first so tails are evicted first."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...], parent: KVBlock | None) -> KVBlock | None:
        """The cached block for this hash, confirmed by its tokens and its parent (collisions miss)."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        if block.parent_link != (parent.link if parent is not None else None):
            return None
        return block

    def register(self, block: KVBlock, block_hash: bytes, token_ids: tuple[int, ...], parent: KVBlock | None) -> None:
        """Makes a just-filled block findable by later requests (first writer wins on a hash clash)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        block.parent_link = parent.link if parent is not None else None
        block.epoch = next(self._epochs)
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block and returns how many there were.

        Blocks in use stay with their requests, only no longer findable: no later request can share them.
        """
        forgotten = len(self.cached)
        for block in list(self.cached.values()):
            self._evict(block)
        return forgotten

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash, block.token_ids, block.parent_link = None, (), None
