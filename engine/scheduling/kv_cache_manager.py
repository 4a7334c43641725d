"""Per-request block tables over the BlockPool: allocation as requests grow, prefix-cache hits, freeing."""

from __future__ import annotations

import hashlib
from array import array

from pagedserve.engine.scheduling.block_pool import BlockPool, KVBlock
from pagedserve.engine.scheduling.request import Request


def hash_block(parent_hash: bytes | None, token_ids: tuple[int, ...], extra_key: bytes) -> bytes:
    """Chained block hash: equal hashes mean an equal whole prefix, not just an equal block."""
    digest = hashlib.sha256(parent_hash or extra_key)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        extra_key: bytes = b"",
        long_rope_threshold: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.extra_key = extra_key  # anything besides the tokens that changes the KV (the model)
        # LongRoPE models rotate every token of a sequence longer than this with other factors
        # (models/partial_rope.py): such sequences' blocks are cached apart from shorter ones' with the same tokens.
        self.long_rope_threshold = long_rope_threshold
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_registered: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        # Prefix-cache counters, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def usage(self) -> float:
        return self.pool.usage()

    def num_stored_tokens(self, requests: list[Request]) -> int:
        """Distinct tokens held in KV by these requests: a block shared by several (a cached prefix, the prompt of
        parallel samples) counts once, filled as far as its furthest holder has computed."""
        filled: dict[int, int] = {}
        for request in requests:
            for index, block in enumerate(self.req_blocks.get(request.request_id, ())):
                tokens = min(self.block_size, max(0, request.num_computed_tokens - index * self.block_size))
                filled[block.block_id] = max(filled.get(block.block_id, 0), tokens)
        return sum(filled.values())

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks at the start of the request, and the tokens they hold.

        The last token is never served from cache: its logits are needed to sample the next one. Nor is any
        token of a request that wants prompt logprobs: a cached block has no hidden states to score.
        """
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return [], 0
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for index in range(min(max_blocks, len(request.block_hashes))):
            parent = hits[-1] if hits else None
            block = self.pool.lookup(request.block_hashes[index], self._block_tokens(request, index), parent)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, computed: list[KVBlock] | None = None) -> bool:
        """Makes room for num_new_tokens more tokens (after `computed` cache hits); False if it cannot.

        A block shared with a sibling sequence (n > 1) that is about to be written is copied first.
        """
        computed = computed or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        first_new = request.num_computed_tokens + len(computed) * self.block_size
        num_tokens = first_new + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(blocks) - len(computed)
        write_index = first_new // self.block_size
        copy_on_write = write_index < len(blocks) and blocks[write_index].ref_cnt > 1
        reclaimed = sum(1 for b in computed if b.ref_cnt == 0)  # hits that sit in the free queue
        other_groups = self._other_groups_need(request, first_new, num_tokens, len(computed))
        if num_new_blocks + copy_on_write + other_groups > self.pool.num_free - reclaimed:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        self._take_other_groups_hits(request, len(computed))  # before any allocation can evict a hit
        if copy_on_write:
            self._copy_on_write(blocks, write_index)
        self.pool.take_cached(computed)
        blocks.extend(computed)
        if num_new_blocks > 0:
            blocks.extend(self.pool.allocate(num_new_blocks))
        self._register_full_blocks(request, blocks, num_tokens)
        self._allocate_other_groups(request, first_new, num_tokens)
        return True

    def _other_groups_need(self, request: Request, first_new: int, num_tokens: int, num_hits: int) -> int:
        """Blocks the other KV cache groups take from the pool for this allocation (hybrid_kv_cache_manager.py)."""
        return 0

    def _take_other_groups_hits(self, request: Request, num_hits: int) -> None:
        """The other KV cache groups' share of a prefix-cache hit of `num_hits` blocks (one group here: none)."""

    def _allocate_other_groups(self, request: Request, first_new: int, num_tokens: int) -> None:
        """Allocates the rest of what _other_groups_need counted (one group here: nothing)."""

    def fork(self, parent: Request, child: Request) -> None:
        """Gives `child` the parent's blocks by reference (parallel samples of one prompt)."""
        blocks = list(self.req_blocks[parent.request_id])
        self.pool.take_cached(blocks)
        self.req_blocks[child.request_id] = blocks
        self._num_registered[child.request_id] = self._num_registered.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(source, destination) block copies the runner must do before this step's forward."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _copy_on_write(self, blocks: list[KVBlock], index: int) -> None:
        shared = blocks[index]
        (private,) = self.pool.allocate(1)
        self.pending_copies.append((shared.block_id, private.block_id))
        self.pool.free([shared])
        blocks[index] = private

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Frees the request's blocks beyond the first `num_tokens` tokens (proposals that were rejected).

        They were never registered in the prefix cache: only blocks full of known tokens are."""
        blocks = self.req_blocks.get(request.request_id)
        keep = self.blocks_needed(num_tokens)
        if blocks is None or len(blocks) <= keep:
            return
        extra = blocks[keep:]
        del blocks[keep:]
        self.pool.free(reversed(extra))

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    def _register_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        """Registers the blocks that this step fills (their tokens are known, their KV written this step)."""
        if not self.enable_caching:
            return
        done = self._num_registered.get(request.request_id, 0)
        full = min(num_tokens, request.num_tokens) // self.block_size
        if full <= done:
            return
        self._update_hashes(request)
        for index in range(done, full):
            parent = blocks[index - 1] if index > 0 else None
            tokens = self._block_tokens(request, index)
            self.pool.register(blocks[index], request.block_hashes[index], tokens, parent)
        self._num_registered[request.request_id] = full

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(request.all_token_ids[start : start + self.block_size])

    def _update_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        extra_key = self._extra_key(request)
        for index in range(len(hashes), request.num_tokens // self.block_size):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, self._block_tokens(request, index), extra_key))

    def _extra_key(self, request: Request) -> bytes:
        return self.extra_key + b"long rope" if self.rotates_long(request) else self.extra_key

    def rotates_long(self, request: Request) -> bool:
        """Whether the request's KV is rotated with LongRoPE's long factors: its prompt is past the threshold,
        or it grew past it and was recomputed (outgrew_short_rope)."""
        threshold = self.long_rope_threshold
        if threshold is not None and request.num_prompt_tokens > threshold:
            request.long_rope = True
        return request.long_rope

    def crosses_short_rope(self, request: Request, num_tokens: int) -> bool:
        """Whether a request rotated with LongRoPE's short factors would hold more than its threshold."""
        threshold = self.long_rope_threshold
        return threshold is not None and num_tokens > threshold and not self.rotates_long(request)

    def outgrew_short_rope(self, request: Request) -> bool:
        """Whether the request just grew past the LongRoPE threshold with KV rotated short: transformers then
        rotates the whole sequence with the long factors, so it is recomputed (its block hashes, made with the
        short factors' key, are dropped and made again)."""
        if not self.crosses_short_rope(request, request.num_tokens):
            return False
        request.long_rope = True
        request.block_hashes.clear()
        return True
