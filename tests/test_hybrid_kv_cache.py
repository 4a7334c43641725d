"""KV cache groups for sliding-window layers (Gemma): the groups, the shared cache tensors, the windowed group's
block tables (blocks given back as the window moves, prefix-cache hits that need only the window), the sizing."""

from __future__ import annotations

import torch

from pagedserve.engine.scheduling.hybrid_kv_cache_manager import HybridKVCacheManager, kv_cache_manager
from pagedserve.engine.scheduling.kv_cache_manager import KVCacheManager
from pagedserve.engine.scheduling.request import Request
from pagedserve.engine.scheduling.windowed_blocks import NULL_BLOCK
from pagedserve.engine.worker.kv_caches import allocate_kv_caches
from pagedserve.engine.worker.kv_groups import kv_cache_groups, single_group, window_blocks
from pagedserve.engine.worker.kv_sizing import kv_bytes_per_block, longest_request
from tests.test_block_pool import assert_pool_consistent, make_request
from tests.test_kv_sizing import SPEC

WINDOW, BLOCK = 8, 4
GEMMA2_LAYERS = [WINDOW, None] * 2
GEMMA3_LAYERS = ([WINDOW] * 5 + [None]) * 2


def test_layers_group_by_attention_kind() -> None:
    gemma2 = kv_cache_groups(GEMMA2_LAYERS)
    assert gemma2.windows == (None, WINDOW) and gemma2.layers == ((1, 3), (0, 2)) and gemma2.num_slots == 2
    gemma3 = kv_cache_groups(GEMMA3_LAYERS)
    assert gemma3.windows == (None,) + (WINDOW,) * 5
    assert gemma3.layers == ((5, 11), (0, 1), (2, 3), (4, 6), (7, 8), (9, 10))
    assert kv_cache_groups([None] * 3) == kv_cache_groups([WINDOW] * 3) == single_group(3)


def test_groups_share_each_slots_tensors() -> None:
    groups = kv_cache_groups(GEMMA2_LAYERS)
    spec = SPEC.__class__(**{**SPEC.__dict__, "num_layers": 4})
    caches = allocate_kv_caches(spec, 3, BLOCK, torch.float32, torch.device("cpu"), groups)
    assert caches[0][0] is caches[1][0] and caches[2][1] is caches[3][1]  # layers 0 and 1 are slot 0 of groups
    assert caches[0][0] is not caches[2][0]
    assert kv_bytes_per_block(spec, BLOCK, torch.float32, groups) == kv_bytes_per_block(spec, BLOCK, torch.float32) // 2


def advance(manager: KVCacheManager, request: Request, num_new: int) -> None:
    """Schedules and computes `num_new` tokens; a request whose known tokens are all computed samples one."""
    assert manager.allocate_slots(request, num_new)
    request.num_computed_tokens += num_new
    if request.num_computed_tokens == request.num_tokens:
        request.append_output_token(7)


def prefill(manager: KVCacheManager, request: Request, chunk: int = 16) -> None:
    while request.num_computed_tokens < request.num_prompt_tokens:
        advance(manager, request, min(chunk, request.num_prompt_tokens - request.num_computed_tokens))


def test_a_windowed_group_keeps_only_its_windows_blocks() -> None:
    manager = HybridKVCacheManager(64, BLOCK, [WINDOW])
    request = make_request("a", list(range(40)))
    prefill(manager, request)
    bound = -(-WINDOW // BLOCK) + 1
    windowed = manager.windowed[0]
    for _ in range(20):
        advance(manager, request, 1)
        held = windowed.num_held("a")
        assert held <= bound == window_blocks(WINDOW, 1, BLOCK)
        assert len(manager.block_ids("a")) == -(-request.num_computed_tokens // BLOCK)
        assert manager.pool.num_free == 64 - len(manager.block_ids("a")) - held
    manager.free(request)
    assert manager.pool.num_free == 64
    assert_pool_consistent(manager.pool)


def test_a_prefix_hit_takes_the_windows_blocks_only() -> None:
    manager = HybridKVCacheManager(64, BLOCK, [WINDOW])
    first = make_request("a", list(range(40)))
    prefill(manager, first)
    windowed_table = list(manager.windowed[0].req_blocks["a"])
    manager.free(first)
    second = make_request("b", list(range(40)) + [99, 98])
    hits, cached = manager.get_computed_blocks(second)
    assert cached == 40 and len(hits) == 10
    assert manager.allocate_slots(second, 2, hits)
    table = manager.windowed[0].req_blocks["b"]
    assert [block is NULL_BLOCK for block in table] == [True] * 8 + [False] * 3  # positions 33.. are the window
    assert table[8:10] == windowed_table[8:10]
    manager.free(second)
    assert manager.pool.num_free == 64
    assert_pool_consistent(manager.pool)


def test_a_hit_stops_where_a_windowed_group_lost_its_window() -> None:
    manager = HybridKVCacheManager(64, BLOCK, [WINDOW])
    first = make_request("a", list(range(40)))
    prefill(manager, first)
    windowed_table = list(manager.windowed[0].req_blocks["a"])
    manager.free(first)
    manager.pool._evict(windowed_table[9])  # as if the pool had handed it out again
    hits, cached = manager.get_computed_blocks(make_request("b", list(range(42))))
    assert cached == 36 and len(hits) == 9  # blocks 7 and 8 are the window of position 36
    for block in windowed_table[6:9]:
        manager.pool._evict(block)
    # blocks 0-5 left the window during the prefill but stay cached: a hit that starts at the start needs no more
    assert manager.get_computed_blocks(make_request("c", list(range(42))))[1] == 24
    for block in manager.pool.blocks:
        if block.block_hash is not None and block.block_hash.endswith(manager.windowed[0].tag):
            manager.pool._evict(block)
    assert manager.get_computed_blocks(make_request("d", list(range(42)))) == ([], 0)


def test_parallel_samples_copy_a_shared_windowed_block_before_writing_it() -> None:
    manager = HybridKVCacheManager(16, BLOCK, [WINDOW])
    leader, sibling = make_request("a", list(range(10))), make_request("b", list(range(10)))
    prefill(manager, leader)
    manager.fork(leader, sibling)
    sibling.num_computed_tokens = leader.num_computed_tokens
    sibling.append_output_token(8)
    assert manager.allocate_slots(sibling, 1)
    copies = manager.take_pending_copies()
    assert len(copies) == 2  # the block holding position 10, in each group
    assert manager.block_ids("a")[2] != manager.block_ids("b")[2]
    assert manager.windowed[0].block_ids("a")[2] != manager.windowed[0].block_ids("b")[2]
    manager.free(leader)
    manager.free(sibling)
    assert manager.pool.num_free == 16


def test_one_group_keeps_the_plain_manager() -> None:
    assert type(kv_cache_manager(8, BLOCK, (None,))) is KVCacheManager
    assert isinstance(kv_cache_manager(8, BLOCK, (None, WINDOW)), HybridKVCacheManager)


def test_a_request_fits_in_fewer_blocks_with_windowed_groups() -> None:
    groups = kv_cache_groups(GEMMA2_LAYERS)
    assert longest_request(10, BLOCK, None, 16) == 40
    # blocks for 68 tokens: 17 in the global group, window_blocks(8, 16, 4) = 7 in the windowed one
    assert longest_request(24, BLOCK, groups, 16) == 68
