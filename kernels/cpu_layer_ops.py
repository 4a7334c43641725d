"""Fused float32 CPU ops of a decoder layer (csrc/layer_ops.c): residual add + RMSNorm, SiLU * up, rotary.

Each replaces a chain of torch ops with one threaded pass over memory. They take activations [tokens,
features] in either of the layouts the CPU backend's linear produces (token-major, or the feature-major
transposed view it returns for small batches) and return results in the same layout, so the next matmul
reads them as they are. The CPU backend (kernels/cpu_backend.py) decides where they apply; where not, the
torch code runs.
"""

from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels.cpu_native import bound_kernel, native_library


class LayerOps:
    """The ops bound to the compiled library. Arguments must be float32 CPU tensors outside autograd."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._silu_and_mul = library.silu_and_mul_f32
        self._silu_and_mul.argtypes = [pointer] * 3 + [i64] * 4 + [i32]
        self._add_rms_norm = library.add_rms_norm_f32
        self._add_rms_norm.argtypes = [pointer] * 4 + [i64] * 4 + [ctypes.c_float, i32]
        self._rotary = library.rotary_f32
        self._rotary.argtypes = [pointer] * 3 + [i64] * 5 + [i32]
        for function in (self._silu_and_mul, self._add_rms_norm, self._rotary):
            function.restype = None

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up for gate_up = [gate | up], [T, 2I] -> [T, I], in gate_up's layout."""
        tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
        token_stride, feature_stride = _layout(gate_up)
        if feature_stride == 1:  # a token's gate and up are runs of `width` floats
            out = torch.empty(tokens, width)
            rows, run, in_stride, out_stride, up_offset = tokens, width, token_stride, width, width
        else:  # a feature's tokens are a run of `tokens` floats
            out = torch.empty(width, tokens).t()
            rows, run, in_stride, out_stride, up_offset = width, tokens, feature_stride, tokens, width * feature_stride
        gate = gate_up.data_ptr()
        self._silu_and_mul(
            out.data_ptr(), gate, gate + 4 * up_offset, rows, run, in_stride, out_stride, torch.get_num_threads()
        )
        return out

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """hidden += delta in place (when given), then RMSNorm(hidden) * weight, in hidden's layout."""
        if not is_dense_activation(hidden):  # out is allocated like hidden
            raise ValueError(f"hidden must be dense in either layout, got strides {hidden.stride()}")
        token_stride, feature_stride = _layout(hidden)
        tokens, features = hidden.shape
        if delta is not None and delta.stride() != hidden.stride():
            delta = torch.empty_like(hidden).copy_(delta)  # layouts differ: one copy, then a single pass
        out = torch.empty_like(hidden)
        self._add_rms_norm(
            out.data_ptr(),
            hidden.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            tokens,
            features,
            token_stride,
            feature_stride,
            eps,
            torch.get_num_threads(),
        )
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotates x [T, H, D] in place; cos, sin [T, D/2] when x is token-major, [D/2, T] when feature-major."""
        if not heads_in_feature_order(x):
            raise ValueError(f"x must keep each token's heads in feature order, got strides {x.stride()}")
        tokens, heads, head_dim = x.shape
        token_stride, _, feature_stride = x.stride()
        expected = (tokens, head_dim // 2) if feature_stride == 1 else (head_dim // 2, tokens)
        if cos.shape != expected or sin.shape != expected or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"cos and sin must be contiguous {expected}, got {tuple(cos.shape)}")
        self._rotary(
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            tokens,
            heads,
            head_dim,
            token_stride,
            feature_stride,
            torch.get_num_threads(),
        )


@bound_kernel
def layer_ops() -> LayerOps | None:
    library = native_library()
    return None if library is None else LayerOps(library)


def heads_in_feature_order(x: torch.Tensor) -> bool:
    """x [T, H, D] is a view of a token-major or feature-major [T, H * D] activation (what rotary takes)."""
    token_stride, head_stride, feature_stride = x.stride()
    return head_stride == x.shape[2] * feature_stride and 1 in (token_stride, feature_stride)


def is_dense_activation(x: torch.Tensor) -> bool:
    """x is a [T, F] activation laid out densely, token-major or feature-major (what add_rms_norm takes)."""
    return x.dim() == 2 and (x.is_contiguous() or x.t().is_contiguous())


def _layout(x: torch.Tensor) -> tuple[int, int]:
    """(token stride, feature stride) of a [T, F] activation; one of them must be 1."""
    if x.dim() != 2:
        raise ValueError(f"expected a [tokens, features] tensor, got shape {tuple(x.shape)}")
    token_stride, feature_stride = x.stride()
    if feature_stride == 1 or x.shape[1] == 1:
        return token_stride, 1
    if token_stride == 1 or x.shape[0] == 1:
        return 1, feature_stride
    raise ValueError(f"expected a token-major or feature-major tensor, got strides {x.stride()}")
