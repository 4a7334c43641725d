"""Sliding-window and soft-capped attention (Gemma's layers), on the torch reference and the CPU backend.

The reference is checked against attention written out one query at a time over exactly the keys it may see;
the CPU backend (native kernel, and its torch paths) against the reference. Triton's are in test_kernels_triton.py.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu_attention import NATIVE_PREFILL_MAX_LEN
from pagedserve.kernels.cpu_backend import CpuBackend
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.torch_reference import (
    gather_sequence_kv,
    paged_attention_reference,
    write_kv_reference,
)
from tests.kernel_cases import MIXED_BATCHES, PagedCase, make_paged_case

# (window, cap): a window shorter than a block, one spanning blocks, a cap alone, both (Gemma 2's sliding layers)
SETTINGS = [(3, None), (20, None), (None, 5.0), (8, 2.0)]
LONG_PREFILL = ([NATIVE_PREFILL_MAX_LEN + 300, 30], [400, 1])  # the CPU backend's SDPA-path chunk, next to a decode


def _case(seq_lens: list[int], query_lens: list[int], **kwargs) -> PagedCase:
    case = make_paged_case(seq_lens, query_lens, **kwargs)
    write_kv_reference(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    return case


def _reference(case: PagedCase, window: int | None, cap: float | None) -> torch.Tensor:
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc)
    return paged_attention_reference(*args, case.scale, window, cap)


def _one_query_at_a_time(case: PagedCase, window: int | None, cap: float | None) -> torch.Tensor:
    """Each query over the keys [pos - window + 1, pos], scores capped, softmax: nothing shared, nothing masked."""
    out = torch.empty_like(case.query)
    starts = case.query_start_loc.tolist()
    group = case.query.shape[1] // case.k_cache.shape[2]
    for seq, seq_len in enumerate(case.seq_lens.tolist()):
        keys = gather_sequence_kv(case.k_cache, case.block_tables[seq], seq_len).repeat_interleave(group, 1)
        values = gather_sequence_kv(case.v_cache, case.block_tables[seq], seq_len).repeat_interleave(group, 1)
        num_queries = starts[seq + 1] - starts[seq]
        for i in range(num_queries):
            pos = seq_len - num_queries + i
            first = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,khd->hk", case.query[starts[seq] + i], keys[first : pos + 1]) * case.scale
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            out[starts[seq] + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[first : pos + 1])
    return out


@pytest.mark.parametrize("window,cap", SETTINGS)
@pytest.mark.parametrize("seq_lens,query_lens", [MIXED_BATCHES[3], MIXED_BATCHES[5], ([40], [40])])
def test_reference_sees_only_the_window(seq_lens, query_lens, window, cap) -> None:
    case = _case(seq_lens, query_lens, num_heads=4, num_kv_heads=2)
    expected = _one_query_at_a_time(case, window, cap)
    torch.testing.assert_close(_reference(case, window, cap), expected, atol=1e-5, rtol=1e-5)


def test_reference_window_and_cap_change_the_result() -> None:
    """The test above would pass for a reference that ignored both; this one would not."""
    case = _case([40], [40], num_heads=4, num_kv_heads=2)
    plain = _reference(case, None, None)
    assert not torch.allclose(_reference(case, 8, None)[10:], plain[10:], atol=1e-3)
    assert not torch.allclose(_reference(case, None, 0.5), plain, atol=1e-3)


def _cpu(case: PagedCase, backend: CpuBackend, window: int | None, cap: float | None) -> torch.Tensor:
    block_size = case.k_cache.shape[1]
    metadata = AttentionMetadata.from_tensors(case.block_tables, case.seq_lens, case.query_start_loc, block_size)
    metadata = backend.prepare(metadata)
    return backend.paged_attention(case.query, case.k_cache, case.v_cache, metadata, case.scale, window, cap)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("window,cap", SETTINGS)
@pytest.mark.parametrize("seq_lens,query_lens", [*MIXED_BATCHES[3:], LONG_PREFILL])
def test_cpu_backend_matches_reference(seq_lens, query_lens, window, cap, native) -> None:
    backend = CpuBackend(native=native)
    if native and backend.native_decode is None:
        pytest.skip("no C compiler for the native kernels")
    case = _case(seq_lens, query_lens, num_heads=6, num_kv_heads=2, block_size=16)
    torch.testing.assert_close(_cpu(case, backend, window, cap), _reference(case, window, cap), atol=1e-5, rtol=1e-5)
