"""The CPU backend's attention plan, and its torch paths for what the native kernel does not take.

The plan is made once per step and shared by all layers. It splits the batch into the native kernel's work,
one query row at a time (every decode token, and the rows of prefill chunks whose sequence is short enough
that this beats SDPA's flash kernel: NATIVE_PREFILL_MAX_LEN), and the torch paths: decode sequences sorted by
length and attended in groups of similar length, one gather and one batched SDPA call per group, so little
work goes to padding; other prefill chunks one at a time with SDPA, a loop over sequences, never over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from pagedserve.kernels.metadata import AttentionMetadata

DECODE_GROUP_SIZE = 16  # decode sequences per batched call: bounds padding to the group's longest
# Prefill chunks of sequences up to this long go to the native kernel row by row: it reads each row's keys
# again, from cache, and beats SDPA's flash kernel (gather included) below ~800 tokens on 2 cores
# (`python -m benchmarks.cpu_prefill_attention`: 1.4-1.6x at 64-400 tokens, 0.9x at 800).
NATIVE_PREFILL_MAX_LEN = 512
# A chunk of a few query rows (a decoding sequence verifying proposed tokens) is a few decode rows to the native
# kernel, at any length: SDPA's per-sequence call pays its gather of the whole context for those few rows.
NATIVE_QUERY_MAX_ROWS = 16
WINDOWED_QUERY_ROWS = 256  # query rows of a windowed or capped layer's torch path scored at a time


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # query rows of the group's sequences
    blocks: torch.Tensor  # [group, max_blocks] block ids, flattened row by row for one gather
    mask: torch.Tensor  # [group, 1, 1, max_blocks * block_size] additive: 0 or -inf past each length
    num_seqs: int


@dataclass
class _PrefillSlice:
    seq: int
    query_begin: int
    query_end: int
    seq_len: int
    blocks: torch.Tensor  # block ids covering seq_len tokens

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """[q, seq_len] bool for SDPA, None when the chunk is the whole sequence (plain causal)."""
        query_len = self.query_end - self.query_begin
        if query_len == self.seq_len:
            return None
        query_pos = torch.arange(self.seq_len - query_len, self.seq_len).unsqueeze(1)
        return (torch.arange(self.seq_len).unsqueeze(0) <= query_pos).to(self.blocks.device)


@dataclass
class _NativeRows:
    """The native kernel's work, one entry per query row, longest context first."""

    context_lens: torch.Tensor  # [rows] int32: the tokens each row attends to (its position + 1)
    seq_ids: torch.Tensor  # [rows] int64: each row's sequence, its row of the block tables
    query_rows: torch.Tensor  # [rows] int64: where each row is in the query and the output


@dataclass
class AttentionPlan:
    metadata: AttentionMetadata = field(repr=False)
    starts: list[int]  # query_start_loc on the host
    decode_seqs: list[int]  # sequences with one new token, shortest first
    prefills: list[_PrefillSlice]

    @cached_property
    def native_prefills(self) -> list[_PrefillSlice]:
        return [piece for piece in self.prefills if _native(piece)]

    @cached_property
    def sdpa_prefills(self) -> list[_PrefillSlice]:
        return [piece for piece in self.prefills if not _native(piece)]

    @cached_property
    def native_rows(self) -> _NativeRows:
        # Longest first, so the kernel's threads run out of work at about the same time.
        decodes = self.decode_seqs
        seq_ids = [torch.tensor(decodes, dtype=torch.int64)]
        rows = [torch.tensor([self.starts[i] for i in decodes], dtype=torch.int64)]
        lens = [torch.tensor([self.metadata.seq_lens_host[i] for i in decodes], dtype=torch.int32)]
        for piece in self.native_prefills:  # a loop over sequences: each contributes all its rows at once
            query_len = piece.query_end - piece.query_begin
            seq_ids.append(torch.full((query_len,), piece.seq, dtype=torch.int64))
            rows.append(torch.arange(piece.query_begin, piece.query_end))
            lens.append(torch.arange(piece.seq_len - query_len + 1, piece.seq_len + 1, dtype=torch.int32))
        context_lens, order = torch.cat(lens).sort(descending=True, stable=True)
        device = self.metadata.block_tables.device
        return _NativeRows(
            context_lens=context_lens.to(device),
            seq_ids=torch.cat(seq_ids)[order].to(device),
            query_rows=torch.cat(rows)[order].to(device),
        )

    @cached_property
    def decode_slices(self) -> list[_PrefillSlice]:
        """Each decode sequence as a one-row slice, for the per-sequence path of windowed or capped layers."""
        return [_prefill_slice(self.metadata, seq, self.starts) for seq in self.decode_seqs]

    @cached_property
    def decode_groups(self) -> list[_DecodeGroup]:
        seqs = self.decode_seqs
        return [
            _decode_group(self.metadata, seqs[first : first + DECODE_GROUP_SIZE], self.starts)
            for first in range(0, len(seqs), DECODE_GROUP_SIZE)
        ]


def _native(piece: _PrefillSlice) -> bool:
    return piece.seq_len <= NATIVE_PREFILL_MAX_LEN or piece.query_end - piece.query_begin <= NATIVE_QUERY_MAX_ROWS


def plan_attention(metadata: AttentionMetadata) -> AttentionPlan:
    starts = [0]
    for n in metadata.query_lens_host:
        starts.append(starts[-1] + n)
    decode_seqs = sorted(
        (i for i, n in enumerate(metadata.query_lens_host) if n == 1), key=lambda i: metadata.seq_lens_host[i]
    )
    prefills = [_prefill_slice(metadata, seq, starts) for seq, n in enumerate(metadata.query_lens_host) if n > 1]
    return AttentionPlan(metadata, starts, decode_seqs, prefills)


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
    seq_len = metadata.seq_lens_host[seq]
    blocks = metadata.block_tables[seq, : -(-seq_len // metadata.block_size)].long()
    return _PrefillSlice(seq, starts[seq], starts[seq + 1], seq_len, blocks)


def decode_attention(
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


def prefill_attention(
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


def windowed_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    piece: _PrefillSlice,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> torch.Tensor:
    """prefill_attention for a layer with a sliding window or soft-capped scores: keys before the first query's
    window are neither gathered nor scored; SDPA with a mask where there is no cap (it has no hook for one),
    explicit scores where there is, a bounded number of query rows at a time."""
    query_len = piece.query_end - piece.query_begin
    first_query = piece.seq_len - query_len
    first_key = 0 if sliding_window is None else max(0, first_query - sliding_window + 1)
    block_size = k_cache.shape[1]
    skipped = first_key // block_size * block_size  # whole blocks before the first key
    blocks = piece.blocks[first_key // block_size :]
    key = _gather(k_cache, blocks)[first_key - skipped : piece.seq_len - skipped]
    value = _gather(v_cache, blocks)[first_key - skipped : piece.seq_len - skipped]
    key_pos = torch.arange(first_key, piece.seq_len, device=query.device)
    out = torch.empty_like(query)
    for begin in range(0, query_len, WINDOWED_QUERY_ROWS):  # bounds the scores' memory
        end = min(begin + WINDOWED_QUERY_ROWS, query_len)
        query_pos = torch.arange(first_query + begin, first_query + end, device=query.device).unsqueeze(1)
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        out[begin:end] = _masked_attention(query[begin:end], key, value, visible, scale, soft_cap)
    return out


def _masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """query [q, H, D] over key/value [k, KVH, D] where visible [q, k] -> [q, H, D]."""
    num_queries, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if soft_cap is None:
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            key.transpose(0, 1).unsqueeze(0),
            value.transpose(0, 1).unsqueeze(0),
            attn_mask=visible,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
    grouped = query.reshape(num_queries, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    scores = torch.einsum("qkgd,tkd->kgqt", grouped, key.float()) * scale
    scores = (soft_cap * torch.tanh(scores / soft_cap)).masked_fill_(~visible, float("-inf"))
    out = torch.einsum("kgqt,tkd->qkgd", scores.softmax(dim=-1), value.float())
    return out.reshape(num_queries, num_heads, head_dim).to(query.dtype)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The tokens of `blocks`, in order: [len(blocks) * block_size, KVH, D].

    index_select copies whole blocks and is several times faster on CPU than advanced indexing.
    """
    return cache.index_select(0, blocks).flatten(0, 1)
