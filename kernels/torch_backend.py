"""CPU backend: the kernel contract in vectorised torch.

Decode sequences (one new token each) are sorted by length and attended in groups of similar length, one
batched call per group, so little work goes to padding; sequences with several new tokens (prefill chunks)
are attended one at a time, which is a loop over sequences, never over tokens. The gather indices and masks
are planned once per step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.backend import AttentionBackend
from kernels.metadata import AttentionMetadata

DECODE_GROUP_SIZE = 16  # decode sequences per batched call: bounds padding to the group's longest


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # query rows of the group's sequences
    blocks: torch.Tensor  # [group, max_blocks] block ids, flattened row by row for one gather
    mask: torch.Tensor  # [group, 1, 1, max_blocks * block_size] additive: 0 or -inf past each length
    num_seqs: int


@dataclass
class _PrefillSlice:
    query_begin: int
    query_end: int
    seq_len: int
    blocks: torch.Tensor  # block ids covering seq_len tokens
    mask: torch.Tensor | None  # [q, seq_len] bool, None when the chunk is the whole sequence


@dataclass
class _TorchPlan:
    decodes: list[_DecodeGroup]
    prefills: list[_PrefillSlice]
    num_tokens: int


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
        out = torch.empty_like(query)
        for group in plan.decodes:
            out.index_copy_(0, group.rows, _decode_attention(query[group.rows], k_cache, v_cache, group, scale))
        for piece in plan.prefills:
            out[piece.query_begin : piece.query_end] = _prefill_attention(
                query[piece.query_begin : piece.query_end], k_cache, v_cache, piece, scale
            )
        return out


def _plan(metadata: AttentionMetadata) -> _TorchPlan:
    starts = [0]
    for n in metadata.query_lens_host:
        starts.append(starts[-1] + n)
    decode_seqs = sorted(
        (i for i, n in enumerate(metadata.query_lens_host) if n == 1), key=lambda i: metadata.seq_lens_host[i]
    )
    decodes = [
        _decode_group(metadata, decode_seqs[first : first + DECODE_GROUP_SIZE], starts)
        for first in range(0, len(decode_seqs), DECODE_GROUP_SIZE)
    ]
    prefills = [_prefill_slice(metadata, seq, starts) for seq, n in enumerate(metadata.query_lens_host) if n > 1]
    return _TorchPlan(decodes, prefills, starts[-1])


def _decode_group(metadata: AttentionMetadata, seqs: list[int], starts: list[int]) -> _DecodeGroup:
    block_size = metadata.block_size
    lens = torch.tensor([metadata.seq_lens_host[i] for i in seqs])
    num_blocks = -(-int(lens.max()) // block_size)
    index = torch.tensor(seqs, device=metadata.block_tables.device)
    blocks = metadata.block_tables[index, :num_blocks].long().flatten()
    past_end = torch.arange(num_blocks * block_size).unsqueeze(0) >= lens.unsqueeze(1)
    # An additive float mask: CPU SDPA takes a faster path for it than for a boolean one.
    mask = torch.zeros(past_end.shape).masked_fill_(past_end, float("-inf")).view(len(seqs), 1, 1, -1)
    rows = torch.tensor([starts[i] for i in seqs], device=metadata.block_tables.device)
    return _DecodeGroup(rows, blocks, mask.to(metadata.block_tables.device), len(seqs))


def _prefill_slice(metadata: AttentionMetadata, seq: int, starts: list[int]) -> _PrefillSlice:
    query_len, seq_len = metadata.query_lens_host[seq], metadata.seq_lens_host[seq]
    blocks = metadata.block_tables[seq, : -(-seq_len // metadata.block_size)].long()
    mask = None
    if query_len != seq_len:
        query_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
        mask = (torch.arange(seq_len).unsqueeze(0) <= query_pos).to(blocks.device)
    return _PrefillSlice(starts[seq], starts[seq + 1], seq_len, blocks, mask)


def _decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _DecodeGroup, scale: float
) -> torch.Tensor:
    """query [B, H, D] -> [B, H, D]: one new token per sequence over its padded, masked context."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    key = _gather(k_cache, group.blocks).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    value = _gather(v_cache, group.blocks).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    # The heads that share a KV head become that head's query rows: [B, KVH, group, D].
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=group.mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, piece: _PrefillSlice, scale: float
) -> torch.Tensor:
    """query [q, H, D], the last q positions of a sequence of piece.seq_len tokens -> [q, H, D]."""
    # [1, heads, tokens, D]: CPU SDPA runs its flash kernel only on 4-D inputs (3-D falls back to the
    # unfused math path, about 3x slower at a few hundred tokens).
    key = _gather(k_cache, piece.blocks)[: piece.seq_len].transpose(0, 1).unsqueeze(0)
    value = _gather(v_cache, piece.blocks)[: piece.seq_len].transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        key,
        value,
        attn_mask=piece.mask,
        is_causal=piece.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The tokens of `blocks`, in order: [len(blocks) * block_size, KVH, D].

    index_select copies whole blocks and is several times faster on CPU than advanced indexing.
    """
    return cache.index_select(0, blocks).flatten(0, 1)
