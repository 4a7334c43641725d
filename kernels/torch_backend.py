"""CPU backend: the kernel contract in vectorised torch.

Decode sequences (one new token each) are attended in one batched call over their gathered blocks;
sequences with several new tokens (prefill chunks) are attended one sequence at a time, which is a loop over
sequences, never over tokens. The gather indices are planned once per step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.backend import AttentionBackend
from kernels.metadata import AttentionMetadata


@dataclass
class _PrefillSlice:
    query_begin: int
    query_end: int
    seq_len: int
    blocks: torch.Tensor  # block ids covering seq_len tokens
    mask: torch.Tensor | None  # [q, seq_len] bool, None when the chunk is the whole sequence


@dataclass
class _TorchPlan:
    decode_tokens: torch.Tensor | None  # query rows of decode sequences
    decode_blocks: torch.Tensor | None  # [num_decodes, max_blocks] block ids
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[_PrefillSlice]


class TorchBackend(AttentionBackend):
    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        slots = slot_mapping.long()
        valid = slots >= 0
        if not bool(valid.all()):
            slots, key, value = slots[valid], key[valid], value[valid]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        metadata.plan = _plan(metadata)
        return metadata

    def paged_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        plan: _TorchPlan = metadata.plan if metadata.plan is not None else _plan(metadata)
        if not plan.prefills and plan.decode_tokens is not None and len(plan.decode_tokens) == len(query):
            return _decode_attention(query, k_cache, v_cache, plan, scale)  # decode-only: no scatter
        out = torch.empty_like(query)
        if plan.decode_tokens is not None:
            out[plan.decode_tokens] = _decode_attention(query[plan.decode_tokens], k_cache, v_cache, plan, scale)
        for piece in plan.prefills:
            out[piece.query_begin : piece.query_end] = _prefill_attention(
                query[piece.query_begin : piece.query_end], k_cache, v_cache, piece, scale
            )
        return out


def _plan(metadata: AttentionMetadata) -> _TorchPlan:
    block_size = metadata.block_size
    starts = [0]
    for n in metadata.query_lens_host:
        starts.append(starts[-1] + n)
    decode_seqs = [i for i, n in enumerate(metadata.query_lens_host) if n == 1]
    prefills = []
    for seq, query_len in enumerate(metadata.query_lens_host):
        if query_len <= 1:
            continue
        seq_len = metadata.seq_lens_host[seq]
        blocks = metadata.block_tables[seq, : -(-seq_len // block_size)].long()
        mask = None
        if query_len != seq_len:
            query_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
            mask = torch.arange(seq_len).unsqueeze(0) <= query_pos
        prefills.append(_PrefillSlice(starts[seq], starts[seq + 1], seq_len, blocks, mask))
    if not decode_seqs:
        return _TorchPlan(None, None, None, prefills)
    lens = torch.tensor([metadata.seq_lens_host[i] for i in decode_seqs])
    num_blocks = -(-int(lens.max()) // block_size)
    rows = torch.tensor(decode_seqs)
    decode_blocks = metadata.block_tables[rows, :num_blocks].long()
    key_pos = torch.arange(num_blocks * block_size)
    decode_mask = (key_pos.unsqueeze(0) < lens.unsqueeze(1)).view(len(decode_seqs), 1, 1, -1)
    decode_tokens = torch.tensor([starts[i] for i in decode_seqs])
    return _TorchPlan(decode_tokens, decode_blocks, decode_mask, prefills)


def _decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _TorchPlan, scale: float
) -> torch.Tensor:
    """query [B, H, D] -> [B, H, D]: one new token per sequence over its padded, masked context."""
    assert plan.decode_blocks is not None
    num_seqs = plan.decode_blocks.shape[0]
    key = _gather(k_cache, plan.decode_blocks.flatten()).view(num_seqs, -1, *k_cache.shape[2:]).transpose(1, 2)
    value = _gather(v_cache, plan.decode_blocks.flatten()).view(num_seqs, -1, *v_cache.shape[2:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), key, value, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def _prefill_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, piece: _PrefillSlice, scale: float
) -> torch.Tensor:
    """query [q, H, D], the last q positions of a sequence of piece.seq_len tokens -> [q, H, D]."""
    key = _gather(k_cache, piece.blocks)[: piece.seq_len].transpose(0, 1)
    value = _gather(v_cache, piece.blocks)[: piece.seq_len].transpose(0, 1)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        key,
        value,
        attn_mask=piece.mask,
        is_causal=piece.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The tokens of `blocks`, in order: [len(blocks) * block_size, KVH, D].

    index_select copies whole blocks and is several times faster on CPU than advanced indexing.
    """
    return cache.index_select(0, blocks).flatten(0, 1)
