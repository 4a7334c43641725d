"""The Triton backend against the torch reference: on CPU tensors through Triton's interpreter, or compiled
on CUDA where there is a GPU.

Shapes are small because the interpreter executes every program in Python; bfloat16 is left to the GPU
tests since the interpreter computes it wrongly on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the kernels run in Triton's interpreter. Triton chooses between compiling and interpreting
# when a function is decorated, its own library included, so this must precede triton's first import.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from pagedserve import kernels
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.torch_reference import paged_attention_reference, write_kv_reference
from tests.kernel_cases import MIXED_BATCHES, PagedCase, make_paged_case, triton_test_device

triton = pytest.importorskip("triton")
triton_backend = pytest.importorskip("pagedserve.kernels.triton_backend")
SplitKVPolicy, TritonBackend = triton_backend.SplitKVPolicy, triton_backend.TritonBackend


DEVICE = triton_test_device(triton_backend.triton_attention._paged_attention_kernel)
FORCED_SPLITS = SplitKVPolicy(target_programs=64, min_tokens_per_split=16)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3}


def _case(seq_lens: list[int], query_lens: list[int], *args, **kwargs) -> PagedCase:
    """A case whose new keys/values the reference has already written: ready to attend."""
    case = make_paged_case(seq_lens, query_lens, *args, device=DEVICE, **kwargs)
    write_kv_reference(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    return case


def _metadata(case: PagedCase, backend: TritonBackend) -> AttentionMetadata:
    block_size = case.k_cache.shape[1]
    metadata = AttentionMetadata.from_tensors(case.block_tables, case.seq_lens, case.query_start_loc, block_size)
    return backend.prepare(metadata)


def _assert_matches_reference(
    case: PagedCase, out: torch.Tensor, window: int | None = None, cap: float | None = None
) -> None:
    """The reference runs on the CPU (its masks are CPU tensors) from the same cache contents."""
    inputs = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc)
    expected = paged_attention_reference(*(t.cpu() for t in inputs), case.scale, window, cap)
    tol = TOLERANCE[case.query.dtype]
    torch.testing.assert_close(out.cpu(), expected, atol=tol, rtol=tol)


def _attend(case: PagedCase, backend: TritonBackend, query: torch.Tensor | None = None) -> torch.Tensor:
    query = case.query if query is None else query
    return backend.paged_attention(query, case.k_cache, case.v_cache, _metadata(case, backend), case.scale)


@pytest.mark.parametrize("seq_lens,query_lens", MIXED_BATCHES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_dim,block_size,dtype", [(64, 16, torch.float32), (128, 32, torch.float16)])
def test_attention_matches_reference(
    seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
) -> None:
    case = _case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype)
    _assert_matches_reference(case, _attend(case, TritonBackend()))


MIXED = MIXED_BATCHES[-1]  # a prefill chunk starting mid-sequence next to decodes
DECODES = MIXED_BATCHES[3]  # decodes of several blocks, at a block boundary and of one token


@pytest.mark.parametrize(
    "batch,head_dim,block_size,dtype",
    [
        (MIXED, 128, 32, torch.float16),
        (DECODES, 128, 16, torch.float16),
        (MIXED, 128, 16, torch.float32),
        (MIXED, 64, 32, torch.float16),
        (MIXED, 80, 16, torch.float32),  # head_dim padded to 128 inside the kernel
        (DECODES, 64, 8, torch.float16),  # a key tile spans several cache blocks
        (MIXED, 64, 128, torch.float32),  # a cache block spans several key tiles
    ],
)
def test_attention_across_head_dims_block_sizes_and_dtypes(batch, head_dim, block_size, dtype) -> None:
    case = _case(*batch, num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype)
    _assert_matches_reference(case, _attend(case, TritonBackend()))


LONG_DECODES = ([300, 129, 1], [1, 1, 1])
# The chunk's first rows see no key of the last split's key tile: that split's softmax starts empty.
CHUNK_ACROSS_SPLITS = ([200, 300, 1], [20, 1, 1])


@pytest.mark.parametrize(
    "batch,dtype",
    [(LONG_DECODES, torch.float32), (LONG_DECODES, torch.float16), (CHUNK_ACROSS_SPLITS, torch.float32)],
)
def test_split_kv_matches_reference(batch, dtype) -> None:
    case = _case(*batch, num_heads=6, num_kv_heads=2, dtype=dtype)
    backend = TritonBackend(FORCED_SPLITS)
    assert backend.launch_for(_metadata(case, backend), 6, 2, 64).num_splits > 1
    _assert_matches_reference(case, _attend(case, backend))


def _lengths_metadata(seq_lens: list[int], query_lens: list[int] | None = None) -> AttentionMetadata:
    query_lens = query_lens or [1] * len(seq_lens)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(seq_lens) // 16 + 1, dtype=torch.int32)
    return AttentionMetadata.from_tensors(block_tables, torch.tensor(seq_lens, dtype=torch.int32), starts, 16)


@pytest.mark.parametrize(
    "seq_lens,query_lens,expected_splits",
    [
        ([8192], None, 16),  # 8 programs: split up to the cap
        ([2048] * 8, None, 4),  # 64 programs: ceil(264 / 64) = 5, rounded down to a power of two
        ([8192] * 64, None, 1),  # 512 programs already fill the GPU
        ([300], None, 1),  # too short for two splits of 256 keys
        ([8192, 4000], [1, 100], 1),  # a prefill chunk of several query tiles: no splits
    ],
)
def test_split_count_heuristic(seq_lens, query_lens, expected_splits) -> None:
    backend = TritonBackend(SplitKVPolicy(target_programs=264))
    launch = backend.launch_for(_lengths_metadata(seq_lens, query_lens), 32, 8, 128)
    assert launch.num_splits == expected_splits


def test_no_splits_off_cuda_by_default() -> None:
    launch = TritonBackend().launch_for(_lengths_metadata([8192]), 32, 8, 128)
    assert launch.num_splits == 1


def test_launch_is_planned_once_per_step() -> None:
    case = _case(*MIXED, num_heads=4, num_kv_heads=2)
    backend = TritonBackend()
    metadata = _metadata(case, backend)
    first = backend.launch_for(metadata, 4, 2, 64)
    backend.paged_attention(case.query, case.k_cache, case.v_cache, metadata, case.scale)
    assert backend.launch_for(metadata, 4, 2, 64) is first


# (window, cap) of Gemma's layers: a window inside one key tile, one across tiles and blocks, a cap, both
WINDOWED = [(5, None), (40, None), (None, 3.0), (12, 2.0)]


@pytest.mark.parametrize("window,cap", WINDOWED)
@pytest.mark.parametrize("batch", [MIXED, ([90, 70], [50, 1])])
def test_sliding_window_and_soft_cap_match_reference(batch, window, cap) -> None:
    case = _case(*batch, num_heads=4, num_kv_heads=2, block_size=8)
    backend = TritonBackend()
    out = backend.paged_attention(
        case.query, case.k_cache, case.v_cache, _metadata(case, backend), case.scale, window, cap
    )
    _assert_matches_reference(case, out, window, cap)


@pytest.mark.parametrize("window,cap", [(70, None), (200, 2.0)])
def test_sliding_window_across_kv_splits_matches_reference(window, cap) -> None:
    case = _case(*LONG_DECODES, num_heads=6, num_kv_heads=2)
    backend = TritonBackend(FORCED_SPLITS)
    metadata = _metadata(case, backend)
    assert backend.launch_for(metadata, 6, 2, 64).num_splits > 1
    out = backend.paged_attention(case.query, case.k_cache, case.v_cache, metadata, case.scale, window, cap)
    _assert_matches_reference(case, out, window, cap)


def test_query_may_be_a_slice_of_fused_qkv() -> None:
    case = _case(*MIXED, num_heads=6, num_kv_heads=2)
    qkv = torch.cat([case.query, case.key, case.value], dim=1)  # [T, 6 + 2 + 2, D]
    _assert_matches_reference(case, _attend(case, TritonBackend(), query=qkv[:, :6]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference_and_skips_padding(dtype) -> None:
    case = make_paged_case([20, 5, 40], [4, 5, 1], num_heads=4, num_kv_heads=2, dtype=dtype, device=DEVICE)
    slots = case.slot_mapping.clone()
    slots[[1, 6]] = -1
    qkv = torch.cat([case.query, case.key, case.value], dim=1)  # key/value as strided views of a fused output
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    expected_k, expected_v = case.k_cache.clone(), case.v_cache.clone()
    write_kv_reference(key, value, expected_k, expected_v, slots)
    TritonBackend().write_kv(key, value, case.k_cache, case.v_cache, slots)
    assert torch.equal(case.k_cache, expected_k) and torch.equal(case.v_cache, expected_v)


def test_kernels_entry_points_reach_the_triton_backend() -> None:
    case = make_paged_case(*DECODES, device=DEVICE)
    kernels.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping, backend="triton")
    args = (case.block_tables, case.seq_lens, case.query_start_loc, case.scale)
    out = kernels.paged_attention(case.query, case.k_cache, case.v_cache, *args, backend="triton")
    _assert_matches_reference(case, out)


@pytest.mark.parametrize(
    "dtype,head_dim,block_size,bad",
    [
        (torch.float64, 128, 16, "dtype .* got torch.float64"),
        (torch.float16, 112, 16, "head_dim .* got 112"),
        (torch.float16, 128, 24, "block_size .* got 24"),
        (torch.float16, 128, 4, "block_size .* got 4"),
        (torch.float16, 128, 256, "block_size .* got 256"),
    ],
)
def test_check_supported_names_the_bad_value(dtype, head_dim, block_size, bad) -> None:
    with pytest.raises(ValueError, match=f"{bad}$"):
        TritonBackend().check_supported(dtype, head_dim, block_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,block_size", [(64, 8), (80, 16), (96, 32), (128, 64), (256, 128)])
def test_check_supported_accepts(dtype, head_dim, block_size) -> None:
    TritonBackend().check_supported(dtype, head_dim, block_size)
