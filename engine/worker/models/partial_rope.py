"""RoPE for Phi-3 and Phi-4-mini: partial rotary dimensions and LongRoPE's short and long factors.

Every backend rotates a head's dimension i with i + head_dim / 2 over the whole head (transformers'
rotate_half). A model that rotates only its first `rotary_dim` dimensions (partial_rotary_factor < 1) pairs i
with i + rotary_dim / 2 instead. Permuting the query and key rows of each head the same way leaves every
attention score unchanged, so the weights are loaded permuted (`head_row_order`) to put each rotated pair at
(i, i + head_dim / 2) and the dimensions that are not rotated opposite each other with angle 0 (cos 1, sin 0):
the backends, the native CPU decoder and CUDA graphs then run such a model as they run Llama.

LongRoPE (transformers' `_compute_longrope_parameters` and its `longrope_frequency_update`) rotates a whole
sequence with one set of factors: the long ones once the sequence is longer than original_max_position_embeddings,
the short ones before. Under `generate` the prompt is rotated by its own length, and when decoding grows a
sequence past the threshold transformers drops its cache and computes the whole sequence again with the long
factors. Here a token of a sequence that holds n tokens (prompt and output so far) reads rows [0, P) of the
tables while n is at most the threshold (the short factors) and rows [P, 2P) after (`table_rows`: the long
factors). The scheduler recomputes a sequence that grows past the threshold, and prefix caching keeps the two
rotations apart (KVCacheManager.rotates_long).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.engine.worker.models.layers import RotaryEmbedding


def rotary_dim(head_dim: int, rope_parameters: dict[str, Any]) -> int:
    """How many of a head's dimensions RoPE rotates (transformers' int(head_dim * partial_rotary_factor))."""
    return int(head_dim * (rope_parameters.get("partial_rotary_factor") or 1.0))


def long_rope_switch(rope_parameters: dict[str, Any]) -> int | None:
    """original_max_position_embeddings of a LongRoPE model (its long factors' threshold), None for others."""
    if rope_parameters.get("rope_type") != "longrope":
        return None
    return int(rope_parameters["original_max_position_embeddings"])


def needs_partial_rope(head_dim: int, rope_parameters: dict[str, Any]) -> bool:
    """Whether the model's RoPE needs this module rather than layers.RotaryEmbedding."""
    return rotary_dim(head_dim, rope_parameters) < head_dim or long_rope_switch(rope_parameters) is not None


def head_row_order(head_dim: int, rotated: int) -> torch.Tensor:
    """[head_dim]: the checkpoint's row of each of our rows of one query or key head (see the module's doc)."""
    half, pairs = head_dim // 2, rotated // 2
    passing = torch.arange(rotated, head_dim)
    unrotated_first, unrotated_second = passing[: half - pairs], passing[half - pairs :]
    return torch.cat((torch.arange(pairs), unrotated_first, torch.arange(pairs, rotated), unrotated_second))


def permute_heads(weight: torch.Tensor, head_dim: int, rotated: int) -> torch.Tensor:
    """Rows of a query or key projection [heads * head_dim, ...] in our order (head_row_order) per head."""
    order = head_row_order(head_dim, rotated)
    heads = weight.shape[0] // head_dim
    return weight.reshape(heads, head_dim, *weight.shape[1:])[:, order].reshape(weight.shape)


class PartialRotaryEmbedding(RotaryEmbedding):
    """cos/sin tables over the whole head with the unrotated dimensions at angle 0, and for LongRoPE the long
    factors' copy after the short one (see the module's doc). Positions index it through `table_rows`."""

    def __init__(self, head_dim: int, max_positions: int, rope_parameters: dict[str, Any], hf_config: Any) -> None:
        nn.Module.__init__(self)  # the tables are built here, not as RotaryEmbedding builds them
        self.max_positions = max_positions
        self.switch = long_rope_switch(rope_parameters)
        positions = torch.arange(max_positions, dtype=torch.float32)
        inv_freq, scaling = _inverse_frequencies(head_dim, rope_parameters, hf_config, long=False)
        cos, sin = _tables(positions, inv_freq, scaling, head_dim)
        if self.switch is not None:
            long_freq, _ = _inverse_frequencies(head_dim, rope_parameters, hf_config, long=True)
            long_cos, long_sin = _tables(positions, long_freq, scaling, head_dim)
            cos, sin = torch.cat((cos, long_cos)), torch.cat((sin, long_sin))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def table_rows(self, positions: torch.Tensor, sequence_lens: torch.Tensor) -> torch.Tensor:
        """Each token's row of the tables: its position, in the long copy when its sequence (the tokens known
        so far) is longer than the threshold."""
        if self.switch is None:
            return positions
        return positions + (sequence_lens > self.switch).to(positions.dtype) * self.max_positions


def _inverse_frequencies(
    head_dim: int, rope_parameters: dict[str, Any], hf_config: Any, long: bool
) -> tuple[torch.Tensor, float]:
    """[rotary_dim / 2] frequencies and the attention scaling; LongRoPE's long or short ones."""
    rotated = rotary_dim(head_dim, rope_parameters)
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        theta = rope_parameters.get("rope_theta", 10000.0)
        exponents = torch.arange(0, rotated, 2, dtype=torch.float32) / rotated
        return 1.0 / (theta**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"unsupported rope_type {rope_type!r} with partial rotary dimensions")
    switch = long_rope_switch(rope_parameters)
    seq_len = switch + 1 if long and switch is not None else None
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), seq_len=seq_len)
    return inv_freq.float(), float(scaling)


def _tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P, head_dim]: the rotated pairs scaled, the others at cos 1, sin 0 (never scaled)."""
    freqs = torch.outer(positions, inv_freq)
    unrotated = head_dim // 2 - len(inv_freq)
    ones, zeros = torch.ones(len(positions), unrotated), torch.zeros(len(positions), unrotated)
    cos_half = torch.cat((freqs.cos() * scaling, ones), dim=-1)
    sin_half = torch.cat((freqs.sin() * scaling, zeros), dim=-1)
    return torch.cat((cos_half, cos_half), dim=-1), torch.cat((sin_half, sin_half), dim=-1)
