"""One windowed KV cache group's blocks (a sliding-window model's windowed layers, engine/worker/kv_groups.py).

Each request has a block table of its own in this group, from the pool every group shares. A token at position p
reads only the keys of positions p - window + 1 .. p, so before each allocation the blocks wholly before the
window of the first new token go back to the pool; NULL_BLOCK keeps their place in the table (the kernels skip
keys before a query's window, so what block 0 holds there is never read).

Prefix caching: this group's blocks are registered under the request's chained block hashes tagged with the
group, and a cache hit of n blocks needs only the window's blocks before block n (those earlier may be gone).
"""

from __future__ import annotations

from pagedserve.engine.scheduling.block_pool import BlockPool, KVBlock
from pagedserve.engine.scheduling.request import Request

NULL_BLOCK = KVBlock(0)  # never in the pool's free queue; never freed or counted


class WindowedBlocks:
    def __init__(self, pool: BlockPool, block_size: int, window: int, tag: bytes) -> None:
        self.pool = pool
        self.block_size = block_size
        self.window = window
        self.tag = tag  # appended to a block hash: this group's copy of a prefix is cached apart from the others'
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_registered: dict[str, int] = {}

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def num_held(self, request_id: str) -> int:
        """Blocks the request holds in this group (its places of blocks gone out of the window not counted)."""
        return sum(1 for b in self.req_blocks.get(request_id, ()) if b is not NULL_BLOCK)

    def blocks_before_window(self, position: int) -> int:
        """How many of a request's first blocks the token at `position`, and every later one, never reads."""
        return max(0, position - self.window + 1) // self.block_size

    def longest_hit(self, request: Request, max_blocks: int) -> int:
        """The most full blocks, up to max_blocks, whose window before the next token is cached in this group (the
        request's block hashes already made)."""
        needed = -(-(self.window - 1) // self.block_size)
        top = max_blocks  # the end of the run of cached blocks being scanned, from the right
        for index in range(max_blocks - 1, -1, -1):
            if top - index > needed:
                return top
            if self._cached(request, index) is None:
                top = index
        return top

    def hits(self, request: Request, num_blocks: int) -> list[KVBlock]:
        """The table a cache hit of `num_blocks` blocks starts with (longest_hit said they are cached)."""
        first = self.blocks_before_window(num_blocks * self.block_size)
        found = [self._cached(request, index) for index in range(first, num_blocks)]
        assert all(block is not None for block in found), "a window hit the group's scan did not find"
        return [NULL_BLOCK] * first + [block for block in found if block is not None]

    def need(self, request: Request, first_new: int, num_tokens: int, num_hits: int) -> int:
        """Gives back the blocks before the window of `first_new`, then counts the blocks an allocation up to
        `num_tokens` takes from the pool: new ones, a copy of a shared one about to be written, hits lying free."""
        self.drop_before_window(request.request_id, first_new)
        blocks = self.req_blocks.get(request.request_id, [])
        hits = self.hits(request, num_hits) if num_hits else []
        new = max(0, self._blocks_needed(num_tokens) - len(blocks) - len(hits))
        write_index = first_new // self.block_size
        copy = write_index < len(blocks) and blocks[write_index].ref_cnt > 1
        reclaimed = sum(1 for b in hits if b is not NULL_BLOCK and b.ref_cnt == 0)
        return new + copy + reclaimed

    def take_hits(self, request: Request, num_hits: int) -> None:
        """Starts a new request's table with this group's share of a cache hit of `num_hits` blocks (before
        anything is allocated: that could evict them)."""
        hits = self.hits(request, num_hits)
        self.pool.take_cached(b for b in hits if b is not NULL_BLOCK)
        self.req_blocks.setdefault(request.request_id, []).extend(hits)

    def allocate(self, request: Request, first_new: int, num_tokens: int) -> list[tuple[int, int]]:
        """The rest of what `need` counted; returns the (source, destination) block copies to make first."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        copies = []
        write_index = first_new // self.block_size
        if write_index < len(blocks) and blocks[write_index].ref_cnt > 1:
            shared = blocks[write_index]
            (blocks[write_index],) = self.pool.allocate(1)
            copies.append((shared.block_id, blocks[write_index].block_id))
            self.pool.free([shared])
        new = self._blocks_needed(num_tokens) - len(blocks)
        if new > 0:
            blocks.extend(self.pool.allocate(new))
        self._register(request, blocks, num_tokens)
        return copies

    def drop_before_window(self, request_id: str, position: int) -> None:
        """Gives the pool back the blocks the token at `position` and later ones never read."""
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return
        dropped = []
        for index in range(min(self.blocks_before_window(position), len(blocks)) - 1, -1, -1):
            if blocks[index] is NULL_BLOCK:
                break  # dropped at an earlier step, with all before it
            dropped.append(blocks[index])
            blocks[index] = NULL_BLOCK
        self.pool.free(dropped)

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, [])
        self._num_registered.pop(request_id, None)
        self.pool.free(b for b in reversed(blocks) if b is not NULL_BLOCK)

    def fork(self, parent_id: str, child_id: str) -> None:
        blocks = list(self.req_blocks[parent_id])
        self.pool.take_cached(b for b in blocks if b is not NULL_BLOCK)
        self.req_blocks[child_id] = blocks
        self._num_registered[child_id] = self._num_registered.get(parent_id, 0)

    def trim(self, request_id: str, num_tokens: int) -> None:
        blocks = self.req_blocks.get(request_id)
        keep = self._blocks_needed(num_tokens)
        if blocks is None or len(blocks) <= keep:
            return
        extra = blocks[keep:]
        del blocks[keep:]
        self.pool.free(b for b in reversed(extra) if b is not NULL_BLOCK)

    def _register(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        """Registers the blocks this step fills, as KVCacheManager._register_full_blocks does (which made the
        hashes); without a parent link, which a block out of the window no longer has."""
        if not self.pool.enable_caching:
            return
        done = self._num_registered.get(request.request_id, 0)
        full = min(num_tokens, request.num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        for index in range(done, full):
            if blocks[index] is not NULL_BLOCK:
                self.pool.register(
                    blocks[index], request.block_hashes[index] + self.tag, self._tokens(request, index), None
                )
        self._num_registered[request.request_id] = max(done, full)

    def _cached(self, request: Request, index: int) -> KVBlock | None:
        return self.pool.lookup(request.block_hashes[index] + self.tag, self._tokens(request, index), None)

    def _tokens(self, request: Request, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(request.all_token_ids[start : start + self.block_size])

    def _blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
