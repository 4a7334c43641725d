"""Block-format products with 8- and 16-bit activations (csrc/int8_linear.c) against the torch reference of the
same arithmetic (kernels/int8_reference.py), and against the float32 path within the error of x's quantization.

The library is built for the host (AVX-512 VNNI where it has it); the last tests rebuild it for AVX2 alone and
for no AVX at all (PAGEDSERVE_NATIVE_CFLAGS) and run this file's reference tests on each build."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.kernels.cpu_native import EXTRA_CFLAGS_VARIABLE, native_function
from pagedserve.kernels.int8_reference import (
    Q16_MAX,
    dequantize_activations,
    int8_linear_reference,
    quantize_activations,
)
from pagedserve.kernels.quantized import (
    QuantizedWeight,
    allow_tile_unit,
    int8_formats,
    int8_linear_kernel,
    integer_max_tokens,
    quantize,
    quantized_linear,
    tile_unit_takes,
)
from tests.test_kernels_quantized import random_weight

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
QTYPES = ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k")
TOKENS = (1, 2, 5, 8, 15)  # any count: tiles of up to 7 tokens, 8 with AVX-512 (csrc/int8_linear.c), whole and split
BITS = (8, 16)
DTYPES = {8: "int8", 16: "int16"}
NARROWER_BUILDS = {"avx2": "-mno-avx512f", "portable": "-mno-avx"}
KERNEL_PATHS = {"portable": 0, "avx2": 1, "vnni": 2}  # csrc/int8_linear.c's int8_kernel_path()


def weight_of(qtype: str, out_features: int = 96, in_features: int = 768) -> QuantizedWeight:
    return quantize(random_weight(out_features, in_features, seed=4), qtype)


def activations(tokens: int, features: int = 768) -> torch.Tensor:
    """Hidden states with outliers, as a trained model's have: a few features far larger than the rest, and one
    all-zero block (scale 0)."""
    x = torch.randn(tokens, features, generator=torch.Generator().manual_seed(tokens))
    x[:, 5] *= 40.0
    x[:, 64:96] = 0.0
    return x


def integer_product(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    bits: int = 8,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The C kernel's product at any token count (quantized_linear takes it below integer_max_tokens)."""
    kernel = int8_linear_kernel(sixteen_bits=bits == 16)
    assert kernel is not None
    return kernel(x, weight, bias, torch.empty(x.shape[0], weight.shape[0]) if out is None else out)


def native_quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    function = native_function(f"quantize_q{bits}_f32", [pointer, pointer, pointer, pointer, i64, i64, i64])
    assert function is not None
    tokens, features = x.shape
    q = torch.empty(tokens, features, dtype=torch.int8 if bits == 8 else torch.int16)
    d, s = torch.empty(tokens, features // 32), torch.empty(tokens, features // 32)
    assert function(q.data_ptr(), d.data_ptr(), s.data_ptr(), x.data_ptr(), x.stride(0), tokens, features) == 0
    return q, d, s


def kernel_path() -> int:
    function = native_function("int8_kernel_path", [])
    assert function is not None
    return function()


def test_the_kernels_build_for_every_format() -> None:
    assert int8_linear_kernel() is not None and int8_linear_kernel(sixteen_bits=True) is not None
    assert int8_formats() == frozenset(QTYPES)


def test_the_kernel_path_is_the_one_the_build_flags_allow() -> None:
    flags = os.environ.get(EXTRA_CFLAGS_VARIABLE, "")
    cpu_flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "-mno-avx" in flags.split():
        assert kernel_path() == KERNEL_PATHS["portable"]
    elif " avx2" in cpu_flags and " f16c" in cpu_flags and " fma" in cpu_flags:
        vnni = " avx512_vnni" in cpu_flags and " avx512vl" in cpu_flags and "-mno-avx512f" not in flags
        assert kernel_path() == KERNEL_PATHS["vnni" if vnni else "avx2"]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("tokens", (1, 3))
def test_quantized_activations_are_the_reference_bit_for_bit(tokens: int, bits: int) -> None:
    x = activations(tokens) * 0.37
    x[0, 300] = 2.5 * (x[0, 288:320].abs().max() / 127)  # a tie at 8 bits, rounded to even
    for native, reference in zip(native_quantize(x, bits), quantize_activations(x, bits), strict=True):
        assert torch.equal(native, reference)


@pytest.mark.parametrize("bits", BITS)
def test_quantized_activations_are_close_to_x(bits: int) -> None:
    x = activations(4)
    q, d, _ = quantize_activations(x, bits)
    assert q.abs().max() == (127 if bits == 8 else Q16_MAX) and not q[:, 64:96].any()
    error = (dequantize_activations(q, d) - x.double()).reshape(4, -1, 32).abs()
    rounding = x.double().abs().reshape(4, -1, 32) * 2**-23  # of x * (1 / d), in float32
    assert (error <= d.double().unsqueeze(-1) / 2 + rounding + 1e-12).all()  # half a step a block


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_integer_kernel_is_the_reference(qtype: str, tokens: int, bits: int) -> None:
    """Up to float32 sums: ~1e-5 of the largest output, which the integer products do not add to."""
    weight, x = weight_of(qtype), activations(tokens)
    bias = torch.randn(weight.shape[0])
    out = integer_product(x, weight, bias, bits)
    expected = int8_linear_reference(x, weight, bias, bits)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("tokens", (1, 2, 4, 6, 7, 12))
def test_int16_tiles_are_the_reference_on_odd_rows_and_partial_tiles(qtype: str, tokens: int) -> None:
    """37 rows: the 32-weight formats' tiles of two rows end on a row alone; 1 token: a row at a time with its own
    kernel (csrc/int16_dot.c's one_token_32); with AVX-512, 4 and 12 tokens: tiles of four tokens summed together,
    and a tile of eight followed by one of four; 6 and 7: four summed together and the rest a token at a time; with
    AVX2, every token a token at a time, 12 as two tiles of six."""
    weight, x = weight_of(qtype, out_features=37), activations(tokens)
    bias = torch.randn(37)
    expected = int8_linear_reference(x, weight, bias, bits=16)
    out = integer_product(x, weight, bias, bits=16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("qtype", ("q8_0", "q4_0", "q4_1"))
@pytest.mark.parametrize("tokens", (1, 2, 3))
def test_int16_dots_are_the_reference_on_an_odd_number_of_blocks(qtype: str, tokens: int) -> None:
    """25 blocks a row: the one-token kernel's two accumulators end on a block alone; Q4_0's and Q4_1's x in
    nibble order (csrc/q8_activations.c's nibble_order_q16) whatever the count."""
    weight, x = weight_of(qtype, out_features=37, in_features=800), activations(tokens, features=800)
    expected = int8_linear_reference(x, weight, bits=16)
    out = integer_product(x, weight, bits=16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("qtype", ("q4_0", "q4_k"))
def test_integer_kernel_writes_either_layout_and_reads_feature_major_x(qtype: str, bits: int) -> None:
    weight, x = weight_of(qtype), activations(2)
    out = torch.empty(weight.shape[0], 2).t()  # feature-major, as the CPU backend asks
    quantized_linear(x.t().contiguous().t(), weight, out=out, activation_dtype=DTYPES[bits])  # 2: integer
    torch.testing.assert_close(out, int8_linear_reference(x, weight, bits=bits), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("bits", "bounds"), [(8, (1e-4, 0.02)), (16, (1e-7, 1e-4))])
@pytest.mark.parametrize("qtype", QTYPES)
def test_integer_kernel_is_the_float_path_within_the_error_of_quantizing_x(
    qtype: str, bits: int, bounds: tuple[float, float]
) -> None:
    """x rounded to 8 bits a block: an RMS error of ~0.3% of each block's largest feature, so a product's
    relative error of about half a percent here (16 bits: 258 times less); the bounds leave room above it."""
    weight, x = weight_of(qtype), activations(4)
    exact = quantized_linear(x, weight)
    error = (integer_product(x, weight, bits=bits) - exact).norm() / exact.norm()
    assert bounds[0] < error < bounds[1]


def test_float32_and_many_tokens_take_the_float_path() -> None:
    weight = weight_of("q4_0")
    few = activations(2)
    assert torch.equal(quantized_linear(few, weight, activation_dtype="float32"), quantized_linear(few, weight))
    for dtype in DTYPES.values():
        many = activations(integer_max_tokens(dtype))
        assert torch.equal(quantized_linear(many, weight, activation_dtype=dtype), quantized_linear(many, weight))
    with pytest.raises(ValueError, match="activation_dtype must be one of"):
        quantized_linear(few, weight, activation_dtype="int4")


def test_engine_config_names_the_activation_dtypes() -> None:
    assert EngineConfig().activation_dtype == "auto"
    with pytest.raises(ValueError, match="activation_dtype must be one of"):
        EngineConfig(activation_dtype="int4")


@pytest.mark.skipif(bool(os.environ.get(EXTRA_CFLAGS_VARIABLE)), reason="already a narrower build")
@pytest.mark.parametrize("build", NARROWER_BUILDS)
def test_narrower_builds_compute_the_reference(build: str) -> None:
    """This file's reference tests on the library built for AVX2 alone, then without AVX: the other paths of
    csrc/int8_*.c and q8_activations.c (a build takes ~20 s, cached after)."""
    assert_passes_on_build(__file__, "reference and not narrower or kernel_path", build)


def assert_passes_on_build(test_file: str, selected: str, build: str) -> None:
    """The tests of `test_file` that `selected` (pytest's -k) names pass, none skipped, in a process whose library
    is built with NARROWER_BUILDS[build]'s flags."""
    env = {**os.environ, EXTRA_CFLAGS_VARIABLE: NARROWER_BUILDS[build]}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", selected]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]


# ---- AMX's tile unit (csrc/amx_tiles.c): the same integers as the vector unit's tiles -----------------------------

TILE_UNIT_QTYPES = ("q8_0", "q4_0", "q4_1")
needs_tile_unit = pytest.mark.skipif(
    not tile_unit_takes("q4_0"), reason="needs AMX's tile unit (Intel Xeon since Sapphire Rapids, Linux 5.16+)"
)


def vector_unit_product(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor) -> torch.Tensor:
    allowed = allow_tile_unit(False)
    try:
        return integer_product(x, weight, bias, bits=16)
    finally:
        allow_tile_unit(allowed)


def test_the_tile_unit_takes_the_32_weight_formats_alone() -> None:
    if tile_unit_takes("q4_0"):
        assert [q for q in QTYPES if tile_unit_takes(q)] == list(TILE_UNIT_QTYPES)
    assert not any(tile_unit_takes(q) for q in ("q4_k", "q6_k", "f16", "no such format"))


@needs_tile_unit
@pytest.mark.parametrize("qtype", TILE_UNIT_QTYPES)
@pytest.mark.parametrize("tokens", (2, 3, 8, 9, 17))
@pytest.mark.parametrize("in_features", (32, 64, 96, 800))
def test_the_tile_unit_computes_the_vector_units_products(qtype: str, tokens: int, in_features: int) -> None:
    """48 rows (three groups of 16, split between threads); 1-3 blocks a row (fewer than the pipeline's lead and
    lag) and 25 (an odd count); 2-8 tokens in one group, 9 and 17 ending on a group of one."""
    weight = quantize(torch.randn(48, in_features, generator=torch.Generator().manual_seed(1)) * 0.05, qtype)
    x, bias = activations(tokens, in_features), torch.randn(48)
    tiles = integer_product(x, weight, bias, bits=16)
    expected = int8_linear_reference(x, weight, bias, bits=16)
    scale = expected.abs().max().item()
    torch.testing.assert_close(tiles, expected, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(tiles, vector_unit_product(x, weight, bias), rtol=1e-5, atol=1e-6 * scale)


@needs_tile_unit
def test_the_tile_unit_takes_the_largest_integers() -> None:
    """Every integer at +-Q16_MAX, the ends of the two-byte split, and weights at their ends too (Q8_0's -127..127):
    the product's int32 sums at their largest."""
    weight = quantize(torch.tensor([[1.0, -1.0] * 16] * 16), "q8_0")
    x = torch.tensor([[1.0, -1.0] * 16, [-1.0, 1.0] * 16])
    expected = int8_linear_reference(x, weight, bits=16)
    assert expected.abs().min() > 31.9  # |w . x| = 32 for every row and token
    torch.testing.assert_close(integer_product(x, weight, bits=16), expected, rtol=1e-6, atol=0)
