"""The CPU backend against the reference implementation and dense attention."""

from __future__ import annotations

import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels.torch_reference import (
    dense_causal_attention,
    gather_sequence_kv,
    paged_attention_reference,
    write_kv_reference,
)
from tests.kernel_cases import MIXED_BATCHES, make_paged_case


def test_reference_equals_dense_attention_on_contiguous_kv() -> None:
    case = make_paged_case([37], [37], num_heads=6, num_kv_heads=2)
    write_kv_reference(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    out = paged_attention_reference(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        case.scale,
    )
    expected = torch.nn.functional.scaled_dot_product_attention(
        case.query.transpose(0, 1),
        case.key.repeat_interleave(3, dim=1).transpose(0, 1),
        case.value.repeat_interleave(3, dim=1).transpose(0, 1),
        is_causal=True,
        scale=case.scale,
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_lens,query_lens", MIXED_BATCHES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_backend_matches_reference(seq_lens, query_lens, num_heads, num_kv_heads, block_size) -> None:
    case = make_paged_case(seq_lens, query_lens, num_heads, num_kv_heads, block_size=block_size)
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    write_kv_reference(case.key, case.value, ref_k, ref_v, case.slot_mapping)
    kernels.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping, backend="cpu")
    assert torch.equal(case.k_cache, ref_k) and torch.equal(case.v_cache, ref_v)

    args = (case.block_tables, case.seq_lens, case.query_start_loc, case.scale)
    out = kernels.paged_attention(case.query, case.k_cache, case.v_cache, *args, backend="cpu")
    expected = paged_attention_reference(case.query, ref_k, ref_v, *args)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_write_kv_skips_negative_slots() -> None:
    case = make_paged_case([20, 5], [4, 5])
    before_k = case.k_cache.clone()
    slots = case.slot_mapping.clone()
    slots[1] = -1
    kernels.write_kv(case.key, case.value, case.k_cache, case.v_cache, slots, backend="cpu")
    block, offset = divmod(int(case.slot_mapping[1]), case.k_cache.shape[1])
    assert torch.equal(case.k_cache[block, offset], before_k[block, offset])
    block, offset = divmod(int(slots[0]), case.k_cache.shape[1])
    assert torch.equal(case.k_cache[block, offset], case.key[0])


def test_gather_follows_block_table() -> None:
    case = make_paged_case([33], [1], block_size=16)
    gathered = gather_sequence_kv(case.k_cache, case.block_tables[0], 33)
    second_block = int(case.block_tables[0, 1])
    assert torch.equal(gathered[16:32], case.k_cache[second_block])
    assert gathered.shape == (33, 2, 64)


def test_dense_attention_is_causal() -> None:
    q = torch.randn(3, 2, 8)
    k = torch.randn(5, 1, 8)
    v = torch.randn(5, 1, 8)
    out = dense_causal_attention(q, k, v, 1.0)
    # the first query sits at position 2: changing key 4 must not affect it
    k2 = k.clone()
    k2[4] += 10
    torch.testing.assert_close(dense_causal_attention(q, k2, v, 1.0)[0], out[0])


def test_auto_backend_is_cpu_on_cpu() -> None:
    assert kernels.resolve_backend_name("auto", torch.device("cpu")) == "cpu"
    assert kernels.resolve_backend_name("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="attention_backend"):
        kernels.resolve_backend_name("flash", torch.device("cpu"))


def test_torch_is_a_deprecated_name_of_the_cpu_backend() -> None:
    """Configs written before the rename keep working."""
    assert kernels.resolve_backend_name("torch", torch.device("cpu")) == "cpu"
    assert kernels.get_backend("torch").name == "cpu"


def test_many_decodes_of_different_lengths_are_grouped_correctly() -> None:
    # More decode sequences than one group holds, lengths out of order, next to a prefill chunk.
    seq_lens = [5 + 13 * ((7 * i) % 40) for i in range(40)] + [60]
    query_lens = [1] * 40 + [12]
    case = make_paged_case(seq_lens, query_lens, num_heads=6, num_kv_heads=2, block_size=16)
    args = (case.block_tables, case.seq_lens, case.query_start_loc, case.scale)
    out = kernels.paged_attention(case.query, case.k_cache, case.v_cache, *args, backend="cpu")
    expected = paged_attention_reference(case.query, case.k_cache, case.v_cache, *args)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
