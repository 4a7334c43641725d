"""BlockPool and KVCacheManager: accounting, prefix-cache hits, eviction order, collisions."""

from __future__ import annotations

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduling.block_pool import BlockPool, FreeBlockQueue, KVBlock
from pagedserve.engine.scheduling.kv_cache_manager import KVCacheManager
from pagedserve.engine.scheduling.request import Request


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(), max_tokens=16)


def assert_pool_consistent(pool: BlockPool) -> None:
    free = list(pool.free_queue)
    assert len(free) == pool.num_free == len({b.block_id for b in free}), "a block is twice in the free queue"
    assert all(b.ref_cnt == 0 for b in free)
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    in_use = [b for b in pool.blocks if b.ref_cnt > 0]
    assert len(in_use) + len(free) == pool.num_blocks


def test_free_queue_removes_from_the_middle_in_place() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2] and queue.size == 4


def test_allocation_grows_one_block_at_a_time() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(6)))
    assert manager.allocate_slots(request, 6)
    assert len(manager.req_blocks["a"]) == 2
    request.num_computed_tokens = 6
    for total in range(7, 13):
        assert manager.allocate_slots(request, 1)
        request.num_computed_tokens = total
        assert len(manager.req_blocks["a"]) == -(-total // 4)
    manager.free(request)
    assert manager.pool.num_free == 8
    assert_pool_consistent(manager.pool)


def test_allocation_refuses_when_full_and_leaves_no_trace() -> None:
    manager = KVCacheManager(num_blocks=2, block_size=4)
    assert not manager.allocate_slots(make_request("big", list(range(12))), 12)
    assert "big" not in manager.req_blocks and manager.pool.num_free == 2


def test_prefix_hit_reuses_blocks_but_never_the_last_token() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(10)))
    assert manager.allocate_slots(first, 10)
    manager.free(first)
    same = make_request("b", list(range(8)))  # two full blocks, all cached
    hits, num_cached = manager.get_computed_blocks(same)
    assert num_cached == 4  # the second block holds the last token, so it is recomputed
    longer = make_request("c", [*range(9), 99])
    hits, num_cached = manager.get_computed_blocks(longer)
    assert num_cached == 8 and len(hits) == 2
    assert manager.allocate_slots(longer, 2, hits)
    assert manager.req_blocks["c"][:2] == hits
    assert_pool_consistent(manager.pool)


def test_different_prefix_same_block_content_misses() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    manager.allocate_slots(first, 9)
    manager.free(first)
    other = make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])  # same second block, different first block
    assert manager.get_computed_blocks(other)[1] == 0


def test_forced_hash_collision_is_harmless(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedserve.engine.scheduling.kv_cache_manager as kvm

    monkeypatch.setattr(kvm, "hash_block", lambda parent, tokens, extra: b"same")
    manager = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    manager.allocate_slots(first, 9)
    manager.free(first)
    assert manager.get_computed_blocks(make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 1]))[1] == 0
    assert manager.get_computed_blocks(make_request("c", [1, 2, 3, 4, 9, 9, 9, 9, 1]))[1] == 4


def test_eviction_takes_least_recently_freed_and_tails_first() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=2)
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    manager.allocate_slots(request, 6)
    head, middle, tail = manager.req_blocks["a"]
    manager.free(request)
    order = list(manager.pool.free_queue)
    # the never-used block first, then the request's blocks tail first
    assert order[1:] == [tail, middle, head]
    manager.allocate_slots(make_request("b", [7, 8]), 2)
    manager.allocate_slots(make_request("c", [9, 10]), 2)
    assert manager.req_blocks["c"] == [tail]  # the tail was evicted first
    assert head.token_ids == (1, 2) and middle.token_ids == (3, 4)  # still cached
    assert_pool_consistent(manager.pool)


def test_shared_blocks_are_ref_counted() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(9)))
    manager.allocate_slots(a, 9)
    b = make_request("b", list(range(9)))
    hits, cached = manager.get_computed_blocks(b)
    assert cached == 8
    manager.allocate_slots(b, 1, hits)
    assert [blk.ref_cnt for blk in manager.req_blocks["b"][:2]] == [2, 2]
    manager.free(a)
    assert [blk.ref_cnt for blk in manager.req_blocks["b"][:2]] == [1, 1]
    manager.free(b)
    assert manager.pool.num_free == 8
    assert_pool_consistent(manager.pool)


def test_reset_prefix_cache_forgets_every_block_even_in_use() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=2)
    done, running = make_request("done", [1, 2, 3, 4, 5]), make_request("running", [6, 7, 8, 9, 10])
    for request in (done, running):
        manager.allocate_slots(request, 5)  # registers its two full blocks
    manager.free(done)
    assert manager.reset_prefix_cache() == 4
    assert not manager.pool.cached
    assert manager.get_computed_blocks(make_request("again", [1, 2, 3, 4, 5])) == ([], 0)
    assert manager.get_computed_blocks(make_request("shared", [6, 7, 8, 9, 10])) == ([], 0)
    manager.free(running)
    assert manager.pool.num_free == 8
    assert_pool_consistent(manager.pool)
