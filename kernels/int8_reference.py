"""The torch reference of the block-format products with 8-bit activations (csrc/int8_linear.c).

x is quantized per token in blocks of 32 features: d = max |x| / 127, q = round(x / d) (as x * (1 / d), ties to
even), s = d * sum(q): bit for bit what csrc/q8_activations.c computes. The product is then W's dequantized
weights (bit for bit gguf-py's) times d * q, summed in float64: every weight is a product of small integers and
fp16 scales, and d * q a float32 times an integer, so float64 holds the integer form's terms
(d_w * d * (q_w . q) + offsets) exactly; only the C kernel's float32 sums differ from it.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.block_formats import QuantizedWeight
from pagedserve.kernels.quantized_reference import dequantize

# csrc/int8_activations.h's: 127 * 256 + 127, so that an integer is two signed bytes for AMX's tile unit
Q16_MAX = 32639

Q8_BLOCK = 32


def quantize_activations(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] float32 (K a multiple of 32) as (q int8 [T, K], d float32 [T, K / 32], s float32 [T, K / 32]);
    bits=16: q int16, d = max |x| / Q16_MAX."""
    tokens, features = x.shape
    if features % Q8_BLOCK != 0:
        raise ValueError(f"features must be a multiple of {Q8_BLOCK}, got {features}")
    blocks = x.float().reshape(tokens, features // Q8_BLOCK, Q8_BLOCK)
    scale = blocks.abs().amax(dim=-1) / (127 if bits == 8 else Q16_MAX)
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inverse.unsqueeze(-1))
    sums = scale * q.sum(dim=-1)  # an integer sum, exact in float32 (|sum| <= 32 * Q16_MAX < 2^24)
    return q.to(torch.int8 if bits == 8 else torch.int16).reshape(tokens, features), scale, sums


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """d * q as float64 [T, K]: the activations the int8 product multiplies by."""
    tokens, features = q.shape
    blocks = q.double().reshape(tokens, features // Q8_BLOCK, Q8_BLOCK) * scale.double().unsqueeze(-1)
    return blocks.reshape(tokens, features)


def int8_linear_reference(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, bits: int = 8
) -> torch.Tensor:
    """x [T, in] @ W^T + bias as csrc/int8_linear.c computes it (bits=16: int16_linear_f32), in float64 (returned
    as float32)."""
    q, scale, _ = quantize_activations(x, bits)
    out = dequantize_activations(q, scale) @ dequantize(weight).double().T
    if bias is not None:
        out += bias.double()
    return out.float()
