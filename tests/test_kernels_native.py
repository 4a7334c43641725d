"""The native CPU decode-attention kernel: against the reference, inside the CPU backend, and its build."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from pagedserve.kernels import cpu_layer_ops, cpu_native
from pagedserve.kernels.cpu_attention import NATIVE_PREFILL_MAX_LEN
from pagedserve.kernels.cpu_backend import CpuBackend
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.torch_reference import paged_attention_reference, write_kv_reference
from tests.kernel_cases import MIXED_BATCHES, make_paged_case

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture(scope="module")
def kernel() -> cpu_native.DecodeAttention:
    built = cpu_native.decode_attention_kernel()
    assert built is not None, "the kernel must build wherever a C compiler is installed"
    return built


def _decode_all(kernel: cpu_native.DecodeAttention, case, seq_ids: list[int], rows: list[int]) -> torch.Tensor:
    out = torch.full_like(case.query, float("nan"))
    ids = torch.tensor(seq_ids, dtype=torch.int64)
    kernel(
        out,
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens[ids],  # decode: each query over its whole sequence
        ids,
        torch.tensor(rows, dtype=torch.int64),
        case.scale,
    )
    return out


@pytest.mark.parametrize("seq_lens", [[1], [16], [17], [70, 33, 1, 5], [1000, 3, 257]])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (80, 8)])
def test_decode_matches_reference(kernel, seq_lens, num_heads, num_kv_heads, head_dim, block_size) -> None:
    case = make_paged_case(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size)
    write_kv_reference(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    out = _decode_all(kernel, case, list(range(len(seq_lens))), list(range(len(seq_lens))))
    expected = paged_attention_reference(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc, case.scale
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_writes_only_the_rows_it_is_given(kernel) -> None:
    """seq_ids and query_rows pick sequences out of a wider batch, in any order; other rows stay untouched."""
    case = make_paged_case([40, 9, 23], [1, 1, 1], num_heads=6, num_kv_heads=2)
    write_kv_reference(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    out = _decode_all(kernel, case, [2, 0], [2, 0])
    expected = paged_attention_reference(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc, case.scale
    )
    torch.testing.assert_close(out[[0, 2]], expected[[0, 2]], atol=1e-5, rtol=1e-5)
    assert torch.isnan(out[1]).all()


def test_decode_refuses_tensors_it_would_misread(kernel) -> None:
    case = make_paged_case([20], [1])
    args = [torch.empty_like(case.query), case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens]
    ids = [torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)]
    with pytest.raises(ValueError, match="query"):
        kernel(args[0], case.query.double(), *args[2:], *ids, case.scale)
    with pytest.raises(ValueError, match="k_cache"):
        kernel(*args[:2], case.k_cache.transpose(1, 2), *args[3:], *ids, case.scale)
    with pytest.raises(ValueError, match="block_tables"):
        kernel(*args[:4], case.block_tables.long(), *args[5:], *ids, case.scale)
    with pytest.raises(ValueError, match="seq_ids"):
        kernel(*args, ids[0].int(), ids[1], case.scale)


def test_head_dims_the_kernel_cannot_vectorise_take_the_torch_path(kernel) -> None:
    case = make_paged_case([20, 7], [1, 1], num_heads=4, num_kv_heads=2, head_dim=36)
    write_kv_reference(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    with pytest.raises(ValueError, match="head_dim 36"):
        _decode_all(kernel, case, [0, 1], [0, 1])
    backend = CpuBackend(native=True)
    metadata = backend.prepare(
        AttentionMetadata.from_tensors(case.block_tables, case.seq_lens, case.query_start_loc, case.k_cache.shape[1])
    )
    out = backend.paged_attention(case.query, case.k_cache, case.v_cache, metadata, case.scale)
    expected = paged_attention_reference(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc, case.scale
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_lens,query_lens", MIXED_BATCHES)
def test_backend_with_and_without_native_decode_agree(kernel, seq_lens, query_lens) -> None:
    case = make_paged_case(seq_lens, query_lens, num_heads=9, num_kv_heads=3)
    write_kv_reference(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    outputs = []
    for backend in (CpuBackend(native=True), CpuBackend(native=False)):
        metadata = AttentionMetadata.from_tensors(
            case.block_tables, case.seq_lens, case.query_start_loc, case.k_cache.shape[1]
        )
        # A transposed (strided) query, as the CPU projections leave it: the backend must read it right.
        strided_query = case.query.flatten(1).t().contiguous().t().view_as(case.query)
        plan = backend.prepare(metadata)
        outputs.append(backend.paged_attention(strided_query, case.k_cache, case.v_cache, plan, case.scale))
    assert CpuBackend(native=True).native_decode is not None
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)


def test_short_prefills_go_to_the_kernel_row_by_row_and_long_ones_to_sdpa(kernel) -> None:
    """A long prefill chunk, a whole short prompt, a decode and a short chunk after a cached prefix, together."""
    # The last: a few rows of a long sequence (proposed tokens verified): decode rows to the kernel, not SDPA.
    seq_lens, query_lens = [NATIVE_PREFILL_MAX_LEN + 20, 60, 30, 45, NATIVE_PREFILL_MAX_LEN + 90], [40, 60, 1, 12, 5]
    case = make_paged_case(seq_lens, query_lens, num_heads=9, num_kv_heads=3)
    write_kv_reference(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    backend = CpuBackend(native=True)
    metadata = backend.prepare(
        AttentionMetadata.from_tensors(case.block_tables, case.seq_lens, case.query_start_loc, case.k_cache.shape[1])
    )
    plan = metadata.plan
    assert [piece.seq for piece in plan.native_prefills] == [1, 3, 4]
    assert [piece.seq for piece in plan.sdpa_prefills] == [0]
    lens = plan.native_rows.context_lens
    assert lens.tolist() == sorted(lens.tolist(), reverse=True) and lens.numel() == 60 + 1 + 12 + 5
    out = backend.paged_attention(case.query, case.k_cache, case.v_cache, metadata, case.scale)
    expected = paged_attention_reference(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc, case.scale
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A private cache directory, no library built ahead of time and no memoised kernel, restored afterwards."""
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_native, "prebuilt_dirs", list)
    _forget_built_kernels()
    yield tmp_path
    _forget_built_kernels()


def _forget_built_kernels() -> None:
    cpu_native.forget_bound_kernels()


def test_build_is_cached_on_disk(fresh_build) -> None:
    first = cpu_native._build()
    built_at = first.stat().st_mtime_ns
    assert first.parent == fresh_build and cpu_native._build() == first
    assert first.stat().st_mtime_ns == built_at
    assert [p.name for p in fresh_build.iterdir()] == [first.name]  # no scratch files left behind


def test_without_a_working_compiler_the_torch_path_runs(fresh_build, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger="pagedserve.kernels.cpu_native"):
        assert cpu_native.decode_attention_kernel() is None
    assert "using the slower torch path" in caplog.text
    backend = CpuBackend()
    assert backend.native_decode is None and backend.layer_ops is None and backend.skinny_linear is None
    case = make_paged_case([30, 5], [1, 1])
    metadata = AttentionMetadata.from_tensors(case.block_tables, case.seq_lens, case.query_start_loc, 16)
    out = backend.paged_attention(case.query, case.k_cache, case.v_cache, backend.prepare(metadata), case.scale)
    expected = paged_attention_reference(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc, case.scale
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_native_kernels_can_be_switched_off(fresh_build, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_NATIVE_KERNELS", "0")
    assert cpu_native.decode_attention_kernel() is None
    assert cpu_layer_ops.layer_ops() is None
    assert list(fresh_build.iterdir()) == []


def _qkv_views(tokens: int, kv_heads: int, head_dim: int, feature_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """key and value [T, KVH, D] as the model hands them over: views into one fused qkv projection output."""
    width = 2 * kv_heads * head_dim + 64  # the query's features come first
    qkv = torch.randn(width, tokens).t() if feature_major else torch.randn(tokens, width)
    key = qkv[:, 64 : 64 + kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, 64 + kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    return key, value


@pytest.mark.parametrize("feature_major", [False, True])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_write_kv_kernel_matches_reference_in_both_layouts(feature_major, tokens) -> None:
    write_kv = cpu_native.write_kv_kernel()
    assert write_kv is not None
    case = make_paged_case([tokens + 5], [tokens], num_kv_heads=3)
    key, value = _qkv_views(tokens, 3, 64, feature_major)
    slots = case.slot_mapping.clone()
    slots[0] = -1  # padding: skipped
    expected_k, expected_v = case.k_cache.clone(), case.v_cache.clone()
    write_kv_reference(key, value, expected_k, expected_v, slots)
    assert write_kv(key, value, case.k_cache, case.v_cache, slots)
    assert torch.equal(case.k_cache, expected_k) and torch.equal(case.v_cache, expected_v)


def test_write_kv_kernel_refuses_a_slot_past_the_cache_and_writes_nothing() -> None:
    write_kv = cpu_native.write_kv_kernel()
    assert write_kv is not None
    case = make_paged_case([12], [4])
    before = case.k_cache.clone()
    slots = case.slot_mapping.clone()
    slots[-1] = case.k_cache.shape[0] * case.k_cache.shape[1]
    with pytest.raises(IndexError):
        write_kv(case.key, case.value, case.k_cache, case.v_cache, slots)
    assert torch.equal(case.k_cache, before)


def test_write_kv_kernel_declines_what_it_cannot_read() -> None:
    """Another dtype, or keys whose heads are not one run of features: False, and the torch path writes them."""
    write_kv = cpu_native.write_kv_kernel()
    assert write_kv is not None
    case = make_paged_case([10], [3], num_kv_heads=2)
    assert not write_kv(case.key.double(), case.value.double(), case.k_cache, case.v_cache, case.slot_mapping)
    heads_swapped = case.key.transpose(1, 2).contiguous().transpose(1, 2)
    assert not write_kv(heads_swapped, heads_swapped, case.k_cache, case.v_cache, case.slot_mapping)
    expected_k, expected_v = case.k_cache.clone(), case.v_cache.clone()
    write_kv_reference(heads_swapped, heads_swapped, expected_k, expected_v, case.slot_mapping)
    CpuBackend().write_kv(heads_swapped, heads_swapped, case.k_cache, case.v_cache, case.slot_mapping)
    assert torch.equal(case.k_cache, expected_k) and torch.equal(case.v_cache, expected_v)
