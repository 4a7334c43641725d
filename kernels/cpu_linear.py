"""x @ W^T for a decode batch on the CPU: the float32 skinny-matrix kernel in csrc/skinny_linear.c.

MKL tunes for large products; at a decode step's shapes (up to ~100 tokens against each weight matrix) it
leaves most of the CPU idle. `skinny_linear` computes in the feature-major layout the CPU ops pass between
layers ([tokens, features] stored as its transpose) and returns that layout.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from pagedserve.kernels.cpu_native import bound_kernel, native_function

# Token counts the kernel takes. Measured over a step's projections of SmolLM2 (benchmarks/cpu_linear.py, 2
# cores, two runs): 1.4-2.3x torch's matmul at 4-32 tokens, 0.95-1.4x at 1 and at 48-128.
MIN_ROWS, MAX_ROWS = 1, 128
SkinnyLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@bound_kernel
def skinny_linear_kernel() -> SkinnyLinear | None:
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    argtypes = [pointer, i64, pointer, i64, pointer, pointer, i64, i64, i64, ctypes.c_int]
    function = native_function("skinny_linear_f32", argtypes)
    return None if function is None else functools.partial(_skinny_linear, function)


def skinny_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes x [T, in] @ weight [out, in]^T: float32 on the CPU, MIN_ROWS..MAX_ROWS tokens,
    outside autograd."""
    if x.dim() != 2 or not MIN_ROWS <= x.shape[0] <= MAX_ROWS or x.device.type != "cpu":
        return False
    return x.dtype == torch.float32 and weight.dtype == torch.float32 and not x.requires_grad


def _skinny_linear(
    function: Callable[..., int], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [T, in] @ weight [out, in]^T + bias, returned feature-major (a [T, out] view of an [out, T] tensor)."""
    tokens, features = x.shape
    if weight.dim() != 2 or weight.shape[1] != features or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [out, {features}] matrix, got {tuple(weight.shape)}")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{weight.shape[0]}] vector, got {tuple(bias.shape)}")
    if bias is not None and bias.dtype != torch.float32:
        raise ValueError(f"bias must be float32, got {bias.dtype}")
    xt = x.t()  # [in, T]: the kernel reads one row of tokens per input feature
    if xt.stride(1) != 1:
        xt = xt.contiguous()
    out = torch.empty(weight.shape[0], tokens)
    status = function(
        out.data_ptr(),
        tokens,
        xt.data_ptr(),
        xt.stride(0),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        tokens,
        weight.shape[0],
        features,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("skinny_linear: scratch allocation failed")
    return out.t()
