"""The compiled Triton kernels on CUDA at realistic sizes, against the float32 reference on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.kernels.cpu_backend import CpuBackend
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.torch_reference import paged_attention_reference, write_kv_reference
from tests.kernel_cases import PagedCase, make_paged_case

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs compiled Triton kernels (TRITON_INTERPRET=1 is set)", allow_module_level=True)
triton_backend = pytest.importorskip("pagedserve.kernels.triton_backend")
SplitKVPolicy, TritonBackend = triton_backend.SplitKVPolicy, triton_backend.TritonBackend

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
DECODES = ([1, 16, 17, 130, 513, 2048, 3001], [1] * 7)
MIXED = ([1500, 4000, 77, 1024, 33], [512, 1, 1, 1024, 33])  # chunk mid-sequence, decodes, whole prompts
LONG_DECODES = ([8192, 3000], [1, 1])


def _case(batch: tuple[list[int], list[int]], **kwargs) -> PagedCase:
    """A CUDA case with the new keys/values already written (by the CPU backend's torch path, on the GPU)."""
    case = make_paged_case(*batch, device="cuda", **kwargs)
    CpuBackend().write_kv(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    return case


def _metadata(case: PagedCase, backend: TritonBackend) -> AttentionMetadata:
    block_size = case.k_cache.shape[1]
    return backend.prepare(
        AttentionMetadata.from_tensors(case.block_tables, case.seq_lens, case.query_start_loc, block_size)
    )


def _assert_matches_reference(
    case: PagedCase, backend: TritonBackend, query: torch.Tensor | None = None
) -> AttentionMetadata:
    metadata = _metadata(case, backend)
    query = case.query if query is None else query
    out = backend.paged_attention(query, case.k_cache, case.v_cache, metadata, case.scale)
    cpu = [t.cpu() for t in (case.query, case.k_cache, case.v_cache)]
    expected = paged_attention_reference(
        *(t.float() for t in cpu),
        case.block_tables.cpu(),
        case.seq_lens.cpu(),
        case.query_start_loc.cpu(),
        case.scale,
    )
    tol = TOLERANCE[case.query.dtype]
    torch.testing.assert_close(out.cpu().float(), expected, atol=tol, rtol=tol)
    return metadata


@pytest.mark.parametrize("batch", [DECODES, MIXED, LONG_DECODES], ids=["decodes", "mixed", "long-decodes"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_llama_shape(batch, dtype) -> None:
    case = _case(batch, num_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype)
    _assert_matches_reference(case, TritonBackend())


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_head_dims_and_block_sizes(head_dim, block_size) -> None:
    case = _case(MIXED, num_heads=16, num_kv_heads=4, head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16)
    _assert_matches_reference(case, TritonBackend())


@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 32), (12, 4), (28, 4), (64, 8), (14, 2), (16, 1)])
def test_gqa_ratios(num_heads, num_kv_heads) -> None:
    case = _case(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=torch.float16)
    _assert_matches_reference(case, TritonBackend())


@pytest.mark.parametrize("batch", [DECODES, LONG_DECODES, ([700, 9000], [12, 1])], ids=["decodes", "long", "chunk"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_kv(batch, dtype) -> None:
    case = _case(batch, num_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype)
    backend = TritonBackend(SplitKVPolicy(target_programs=1024, min_tokens_per_split=64))
    metadata = _assert_matches_reference(case, backend)
    assert backend.launch_for(metadata, 32, 8, 128).num_splits > 1


def test_default_policy_splits_a_lone_long_decode() -> None:
    case = _case(([8192], [1]), num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    backend = TritonBackend()
    metadata = _assert_matches_reference(case, backend)
    assert backend.launch_for(metadata, 32, 8, 128).num_splits > 1


def test_query_may_be_a_slice_of_fused_qkv() -> None:
    case = _case(MIXED, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    qkv = torch.cat([case.query, case.key, case.value], dim=1)
    _assert_matches_reference(case, TritonBackend(), query=qkv[:, :32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (80, 32), (256, 8)])
def test_write_kv(dtype, head_dim, block_size) -> None:
    case = make_paged_case(
        *MIXED,
        num_heads=32,
        num_kv_heads=8,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
    )
    slots = case.slot_mapping.clone()
    slots[::7] = -1
    qkv = torch.cat([case.query, case.key, case.value], dim=1)
    key, value = qkv[:, 32:40], qkv[:, 40:48]
    expected_k, expected_v = case.k_cache.clone(), case.v_cache.clone()
    write_kv_reference(key, value, expected_k, expected_v, slots)
    TritonBackend().write_kv(key, value, case.k_cache, case.v_cache, slots)
    assert torch.equal(case.k_cache, expected_k) and torch.equal(case.v_cache, expected_v)
