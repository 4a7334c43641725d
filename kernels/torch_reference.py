"""Reference implementation of the kernel contract: one sequence at a time, dense attention.

It is deliberately plain so that it is obviously correct; every other backend is tested against it.
"""

from __future__ import annotations

import torch


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = key[token]
        v_cache[block, offset] = value[token]


def gather_sequence_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` cached tokens of one sequence: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def dense_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """query [q, H, D] are the last q of the key/value positions [k, KVH, D]; returns [q, H, D].

    `sliding_window`: a query sees only the last that many positions, its own included. `soft_cap`: scores
    become soft_cap * tanh(score / soft_cap) before the softmax (Gemma 2)."""
    num_queries, num_heads, _ = query.shape
    num_keys, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    key = key.repeat_interleave(group, dim=1).float()
    value = value.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", query.float(), key) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    query_pos = torch.arange(num_keys - num_queries, num_keys).unsqueeze(1)
    key_pos = torch.arange(num_keys).unsqueeze(0)
    hidden = key_pos > query_pos
    if sliding_window is not None:
        hidden |= key_pos <= query_pos - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, value).to(query.dtype)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        begin, end = starts[seq], starts[seq + 1]
        if end == begin:
            continue
        key = gather_sequence_kv(k_cache, block_tables[seq], seq_len)
        value = gather_sequence_kv(v_cache, block_tables[seq], seq_len)
        out[begin:end] = dense_causal_attention(query[begin:end], key, value, scale, sliding_window, soft_cap)
    return out
