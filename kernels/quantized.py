"""x @ W^T with W kept in ggml's block formats (kernels/block_formats.py: Q8_0, Q5_0, Q5_1, Q4_0, Q4_1 and the
K-quants Q2_K to Q6_K, as GGUF files store them), for the CPU.

A decode step of one sequence reads every weight once: on the CPU it is bound by memory bandwidth, and
these formats are 3.8-12x smaller than float32. `quantized_linear` multiplies float32 activations by the
weight as stored, with the kernels in csrc/quantized_linear.c and csrc/kquant_linear.c (and the formats of
csrc/q5_linear.c and csrc/kquant_low_bits.c, which those two look up): a few tokens dequantize
each block as it streams past; from 16 tokens (prefill, where the product is bound by arithmetic, not by bytes)
rows are dequantized a few at a time into float32 register tiles (csrc/dequantized_tiles.c), so no float32
copy of the whole weight ever exists. Without the compiled library, ROW_TILE rows at a time are dequantized
into torch's matmul.

activation_dtype "int8" quantizes a call's x to 8 bits a block of 32 and multiplies by integer dot products
(csrc/int8_linear.c, as llama.cpp does): faster for a few tokens, no longer the float32 product of the
dequantized weight. "int16" does the same with 16-bit integers (x to ~1e-5), unpacking each weight block once
for up to 8 tokens (csrc/int16_dot.c's tiles). From INTEGER_MAX_TOKENS[activation_dtype] tokens, and for formats
without such a kernel, the float32 path runs whatever the setting. Weights laid out with their rows interleaved
(kernels/interleaved_rows.py: "q4_0_r8", "q4_k_r8", "q6_k_r8") have only the 16-bit product, at every count.
The torch reference (`dequantize`, `quantize`) is in
kernels/quantized_reference.py (int8: kernels/int8_reference.py); both modules' names are importable from here.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.kernels.block_formats import (
    BLOCK,
    FORMATS,
    SUPER_BLOCK,
    BlockFormat,
    QuantizedWeight,
    block_format,
)
from pagedserve.kernels.cpu_native import bound_kernel, native_function
from pagedserve.kernels.interleaved_rows import STORED, as_stored, stored_rows
from pagedserve.kernels.quantized_reference import dequantize, dequantize_rows, quantize

__all__ = [
    "ACTIVATION_DTYPES",
    "BLOCK",
    "FORMATS",
    "INTEGER_MAX_TOKENS",
    "ROW_TILE",
    "SUPER_BLOCK",
    "BlockFormat",
    "QuantizedWeight",
    "allow_tile_unit",
    "block_format",
    "dequantize",
    "dequantize_kernel",
    "int8_linear_kernel",
    "integer_max_tokens",
    "lookup_rows",
    "quantize",
    "quantized_linear",
    "quantized_linear_kernel",
    "tile_unit_takes",
    "tiled_linear",
]

ROW_TILE = 256  # rows dequantized at a time without the kernels: a 256 x 1536 float32 tile is 1.5 MiB
ACTIVATION_DTYPES = ("float32", "int8", "int16")
# Tokens from which integer activations give way to the float32 path, by activation dtype
# (benchmarks/int8_activations.py). int8 unpacks each block again for every token: 1.2-1.8x the float32 path's
# speed at one token, about even at 2-3, slower from 4. int16 unpacks it once for a tile of 8 tokens: 1.07-1.70x
# the float32 path's speed at 1-8 tokens, 0.72-0.89x at 16, where the float32 path's register tiles take over.
INTEGER_MAX_TOKENS = {"int8": 3, "int16": 16}


def integer_max_tokens(activation_dtype: str) -> int:
    """Products of fewer tokens than this take `activation_dtype`'s integer kernel (0: never, as for float32)."""
    return INTEGER_MAX_TOKENS.get(activation_dtype, 0)


def quantized_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    activation_dtype: str = "float32",
    integer_tokens: int | None = None,
) -> torch.Tensor:
    """x [T, in] @ W^T + bias -> [T, out], float32, on the CPU.

    x may be token-major or feature-major (a transposed view); the kernel reads it token-major, copying a
    feature-major x of more than one token. `out` (float32 [T, out], either layout) receives the result where
    given, so a caller may ask for the feature-major layout; otherwise a new token-major tensor does.
    activation_dtype "int8" / "int16": x quantized to 8 / 16 bits where a kernel takes it (see above), chosen by
    x's rows, or by `integer_tokens` where given (a step verifying proposed tokens counts its rows without them,
    so that its products take the path plain decoding's would: engine/worker/model_runner.py).
    """
    _check_operands(x, weight, bias, out)
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0])
    kernel = _kernel_for(x.shape[0] if integer_tokens is None else integer_tokens, weight, activation_dtype)
    if kernel is not None and not x.requires_grad:
        return kernel(x, weight, bias, out)
    return tiled_linear(x, weight, bias, out)


def lookup_rows(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of the weight as float32 [T, in]: an embedding lookup in a table kept as blocks, equal to
    indexing the dequantized table. A table laid out with its rows interleaved (a tied head's,
    kernels/interleaved_rows.py) gives up the groups of eight rows that hold them, put back in row order."""
    ids = ids.to("cpu", torch.long)
    qtype = weight.qtype
    if qtype in STORED:
        rows, qtype = stored_rows(weight.blocks, qtype, ids), STORED[qtype]
    else:
        rows = weight.blocks.index_select(0, ids)
    return (dequantize_kernel() or dequantize_rows)(rows, qtype)


def tiled_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """quantized_linear without the native kernels (and what benchmarks measure them against): float32 matmuls
    of ROW_TILE dequantized rows at a time. Many tokens share each tile, and only one tile exists at a time."""
    dequantize_tile = dequantize_kernel() or dequantize_rows
    for start in range(0, weight.shape[0], ROW_TILE):
        end = min(start + ROW_TILE, weight.shape[0])
        tile = dequantize_tile(weight.blocks[start:end], weight.qtype)
        out[:, start:end] = torch.nn.functional.linear(x, tile, None if bias is None else bias[start:end])
    return out


def _check_operands(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, out: torch.Tensor | None
) -> None:
    """The kernel trusts its pointers: refuse anything it would misread."""
    out_features, in_features = weight.shape
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [tokens, {in_features}], got shape {tuple(x.shape)}")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU tensor, got {x.dtype} {x.device}")
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.float32 or bias.device.type != "cpu"):
        raise ValueError(f"bias must be a float32 CPU [{out_features}] vector, got {bias.dtype} {tuple(bias.shape)}")
    if out is not None and (out.shape != (x.shape[0], out_features) or out.dtype != torch.float32):
        raise ValueError(f"out must be float32 [{x.shape[0]}, {out_features}], got {out.dtype} {tuple(out.shape)}")
    if out is not None and (out.device.type != "cpu" or 1 not in out.stride()):
        raise ValueError(f"out must be a CPU tensor with one of its strides 1, got strides {out.stride()}")


QuantizedLinear = Callable[[torch.Tensor, QuantizedWeight, torch.Tensor | None, torch.Tensor], torch.Tensor]


def _kernel_for(tokens: int, weight: QuantizedWeight, activation_dtype: str) -> QuantizedLinear | None:
    """The int8 kernel where asked for and it takes a product of `tokens` tokens; else the float32 one (None: no
    library)."""
    if activation_dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"activation_dtype must be one of {ACTIVATION_DTYPES}, got {activation_dtype!r}")
    if weight.qtype in STORED:  # laid out for the 16-bit product alone, at any count (kernels/interleaved_rows.py)
        return int8_linear_kernel(sixteen_bits=True)
    if tokens < integer_max_tokens(activation_dtype) and weight.qtype in int8_formats():
        return int8_linear_kernel(activation_dtype == "int16") or quantized_linear_kernel()
    return quantized_linear_kernel()


@bound_kernel
def int8_linear_kernel(sixteen_bits: bool = False) -> QuantizedLinear | None:
    """csrc/int8_linear.c's product with x quantized to 8 bits (or 16), for every format of int8_formats(); None
    where the library cannot be built."""
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    argtypes = [pointer, i64, i64, pointer, i64, pointer, pointer, i64, i64, i64, i32, i32]
    function = native_function("int16_linear_f32" if sixteen_bits else "int8_linear_f32", argtypes)
    return None if function is None else functools.partial(_native_linear, {BLOCK: function, SUPER_BLOCK: function})


@bound_kernel
def int8_formats() -> frozenset[str]:
    """The formats csrc/int8_linear.c multiplies (none without the library)."""
    supports = native_function("int8_linear_supports", [ctypes.c_int])
    if supports is None:
        return frozenset()
    return frozenset(name for name, fmt in FORMATS.items() if supports(fmt.ggml_type))


def tile_unit_takes(qtype: str) -> bool:
    """Whether int16 products of 2+ tokens with weights of `qtype` run on AMX's tile unit here (csrc/amx_tiles.c):
    an Intel CPU that has one, a Linux that grants it, and a format it takes."""
    takes = native_function("amx_tiles_for", [ctypes.c_int])
    return takes is not None and qtype in FORMATS and bool(takes(FORMATS[qtype].ggml_type))


def allow_tile_unit(allow: bool) -> bool:
    """Lets int16 products use the tile unit where it is present (the default), or not; returns the setting it
    had. For benchmarks and tests, which compare the two paths."""
    allow_tiles = native_function("amx_tiles_allow", [ctypes.c_int])
    return allow_tiles is not None and bool(allow_tiles(int(allow)))


NativeFunctions = dict[int, Callable[..., int]]  # a block's weights (BLOCK, SUPER_BLOCK) -> the C function for it


@bound_kernel
def quantized_linear_kernel() -> QuantizedLinear | None:
    """The kernels bound to the compiled library (csrc/quantized_linear.c's for 32-weight blocks,
    csrc/kquant_linear.c's for K-quants), or None where it cannot be built."""
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    argtypes = [pointer, i64, i64, pointer, i64, pointer, pointer, i64, i64, i64, i32, i32]
    functions = _native_functions({BLOCK: "quantized_linear_f32", SUPER_BLOCK: "kquant_linear_f32"}, argtypes)
    return None if functions is None else functools.partial(_native_linear, functions)


@bound_kernel
def dequantize_kernel() -> Callable[[torch.Tensor, str], torch.Tensor] | None:
    """The C dequantization of rows of blocks (what `dequantize_rows` computes, ~40x faster), or None where
    the library cannot be built."""
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    symbols = {BLOCK: "dequantize_f32", SUPER_BLOCK: "kquant_dequantize_f32"}
    functions = _native_functions(symbols, [pointer, pointer, i64, i64, i32, i32])
    return None if functions is None else functools.partial(_native_dequantize, functions)


def _native_functions(symbols: dict[int, str], argtypes: list[Any]) -> NativeFunctions | None:
    """The library's function named for each block size, or None where the library cannot be built."""
    bound = {weights: native_function(symbol, argtypes) for weights, symbol in symbols.items()}
    functions = {weights: function for weights, function in bound.items() if function is not None}
    return functions if len(functions) == len(symbols) else None


def _native_dequantize(functions: NativeFunctions, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """Contiguous rows of blocks [rows, row_bytes] as float32 [rows, in]."""
    blocks, qtype = as_stored(blocks, qtype)
    fmt = FORMATS[qtype]
    rows, in_features = blocks.shape[0], blocks.shape[1] // fmt.block_bytes * fmt.block_weights
    out = torch.empty(rows, in_features)
    function = functions[fmt.block_weights]
    status = function(out.data_ptr(), blocks.data_ptr(), rows, in_features, fmt.ggml_type, torch.get_num_threads())
    if status != 0:
        raise ValueError(f"dequantize: the kernel refused {qtype} blocks of shape {tuple(blocks.shape)}")
    return out


def _native_linear(
    functions: NativeFunctions,
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """out [T, out] = x [T, in] @ W^T + bias with the C kernel; arguments already checked."""
    if x.stride(1) != 1:
        x = x.contiguous()  # feature-major: the kernel reads each token's features as one run
    if bias is not None:
        bias = bias.contiguous()
    out_features, in_features = weight.shape
    fmt = block_format(weight.qtype)
    status = functions[fmt.block_weights](
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        x.data_ptr(),
        x.stride(0),
        weight.blocks.data_ptr(),
        None if bias is None else bias.data_ptr(),
        x.shape[0],
        out_features,
        in_features,
        fmt.ggml_type,
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError("quantized_linear: scratch allocation failed")
    if status != 0:
        raise ValueError(f"quantized_linear: the kernel refused a {weight.qtype} weight of shape {weight.shape}")
    return out
