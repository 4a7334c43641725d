"""The Triton dequant-GEMM against dequantize-then-matmul: on CPU tensors through Triton's interpreter, or
compiled on CUDA where there is a GPU (plus realistic shapes there, marked `gpu`).

The reference multiplies by the dequantized weight rounded to x's dtype, as the kernel feeds tl.dot, so only
float32 accumulation order and the output's rounding differ. bfloat16 is left to the GPU (the interpreter
computes it wrongly on CPU).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

# Without a GPU the kernels run in Triton's interpreter; this must precede triton's first import.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from pagedserve.engine.worker.models.layers import Linear
from pagedserve.kernels.block_formats import FORMATS, QuantizedWeight
from pagedserve.kernels.cpu_backend import CpuBackend
from pagedserve.kernels.device_blocks import DeviceQuantizedWeight, pack_for_device
from pagedserve.kernels.quantized_reference import dequantize, quantize
from tests.kernel_cases import triton_test_device
from tests.test_low_bit_quants import random_blocks

triton = pytest.importorskip("triton")
kernel_module = pytest.importorskip("pagedserve.kernels.triton_quantized_linear")
TritonBackend = pytest.importorskip("pagedserve.kernels.triton_backend").TritonBackend
GemmTiles, choose_tiles, quantized_linear = (
    kernel_module.GemmTiles,
    kernel_module.choose_tiles,
    kernel_module.quantized_linear,
)


DEVICE = triton_test_device(kernel_module._quantized_linear_kernel)
QTYPES = list(FORMATS)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _weight(qtype: str, out_features: int, in_features: int, seed: int = 0) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(out_features, in_features, generator=generator) * 0.05, qtype)


def _in_features(qtype: str, blocks: int) -> int:
    return blocks * FORMATS[qtype].block_weights


def _expected(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + bias in float64 (on the CPU), W dequantized and rounded to x's dtype as the kernel feeds it."""
    w = dequantize(weight).to(x.dtype).double()
    out = x.cpu().double() @ w.T
    return out if bias is None else out + bias.cpu().double()


def _assert_matches(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, tiles: GemmTiles | None = None
) -> None:
    out = quantized_linear(x, pack_for_device(weight, x.device), bias, tiles)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], weight.shape[0])
    tol = TOLERANCE[x.dtype]
    torch.testing.assert_close(out.cpu().double(), _expected(x, weight, bias), atol=tol, rtol=tol)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 17, 40])  # decode tiles (split-K where a GPU asks), then prefill tiles
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_dequantized_matmul(qtype: str, tokens: int, with_bias: bool) -> None:
    """Odd N (a partial row tile); K of 3 blocks for Q8_0/Q4_0/Q4_1 (a K tile of one 32-weight chunk), 2
    super-blocks for the K-quants."""
    in_features = _in_features(qtype, 2 if FORMATS[qtype].block_weights == 256 else 3)
    weight = _weight(qtype, 37, in_features)
    x = torch.randn(tokens, in_features, device=DEVICE)
    bias = torch.randn(37, device=DEVICE) if with_bias else None
    _assert_matches(x, weight, bias)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("tokens", [2, 20])
def test_float16_activations(qtype: str, tokens: int) -> None:
    in_features = _in_features(qtype, 1 if FORMATS[qtype].block_weights == 256 else 8)
    weight = _weight(qtype, 19, in_features, seed=1)
    x = torch.randn(tokens, in_features, device=DEVICE, dtype=torch.float16)
    _assert_matches(x, weight, torch.randn(19, device=DEVICE, dtype=torch.float16))


@pytest.mark.parametrize("qtype", QTYPES)
def test_split_k_partial_sums_add_up(qtype: str) -> None:
    """K in 3 parts of unequal length (5 K tiles over 2 per split), the bias added once after the sum."""
    in_features = _in_features(qtype, 5 if FORMATS[qtype].block_weights == 256 else 10)
    block_k = 256 if FORMATS[qtype].block_weights == 256 else 64
    weight = _weight(qtype, 21, in_features, seed=2)
    x = torch.randn(2, in_features, device=DEVICE)
    _assert_matches(x, weight, torch.randn(21, device=DEVICE), GemmTiles(16, 32, block_k, split_k=3))


@pytest.mark.parametrize("qtype", ["q5_0", "q5_1", "q2_k", "q3_k"])
def test_random_blocks_of_the_low_bit_formats(qtype: str) -> None:
    """Every bit pattern of their quants, high bits and packed scales, not only the ones the quantizers write."""
    weight = random_blocks(qtype, 19, 512, seed=7)
    _assert_matches(torch.randn(3, 512, device=DEVICE), weight, torch.randn(19, device=DEVICE))


def test_many_tokens_and_any_activation_strides() -> None:
    """Prefill-sized tiles (128 x 128), a feature-major x (a transposed view) and one with a row stride past K."""
    weight = _weight("q4_0", 45, 64, seed=3)
    _assert_matches(torch.randn(300, 64, device=DEVICE), weight)
    _assert_matches(torch.randn(64, 5, device=DEVICE).t(), weight)
    _assert_matches(torch.randn(7, 100, device=DEVICE)[:, 10:74], weight)


def test_no_tokens_give_an_empty_output() -> None:
    weight = pack_for_device(_weight("q8_0", 8, 32), DEVICE)
    assert quantized_linear(torch.empty(0, 32, device=DEVICE), weight).shape == (0, 8)


def test_operands_the_kernel_would_misread_are_refused() -> None:
    weight = pack_for_device(_weight("q4_0", 8, 64), DEVICE)
    with pytest.raises(ValueError, match="x must be"):
        quantized_linear(torch.randn(2, 32, device=DEVICE), weight)
    with pytest.raises(ValueError, match="x must be"):
        quantized_linear(torch.zeros(2, 64, dtype=torch.int32, device=DEVICE), weight)
    with pytest.raises(ValueError, match="bias must be"):
        quantized_linear(torch.randn(2, 64, device=DEVICE), weight, torch.randn(7, device=DEVICE))
    with pytest.raises(ValueError, match="block_k must be"):
        quantized_linear(torch.randn(2, 64, device=DEVICE), weight, tiles=GemmTiles(16, 16, 128))


def test_packing_keeps_the_cpu_blocks_and_their_size() -> None:
    for qtype in QTYPES:
        weight = _weight(qtype, 12, _in_features(qtype, 2))
        before = weight.blocks.clone()
        packed = pack_for_device(weight, "cpu")
        assert torch.equal(weight.blocks, before)  # the CPU path keeps GGUF's layout
        assert weight.nbytes <= packed.nbytes <= 1.03 * weight.nbytes, qtype  # 16 bytes for 12 in the K-quants
        assert all(t.is_contiguous() for t in packed.tensors())


def test_tiles_divide_k_and_split_it_only_to_fill_the_gpu() -> None:
    for tokens, out_features, in_features in [(1, 4096, 4096), (40, 4096, 14336), (2048, 14336, 4096), (5, 64, 576)]:
        tiles = choose_tiles(tokens, out_features, in_features, 132)
        assert in_features % tiles.block_k == 0 and tiles.block_k % 32 == 0
    assert choose_tiles(1, 4096, 4096, 132).split_k == 4  # 64 programs: K split towards 264
    assert choose_tiles(1, 28672, 4096, 132).split_k == 1  # 448 programs fill the GPU already
    assert choose_tiles(1, 4096, 4096, 0).split_k == 1  # no GPU (the interpreter)
    assert choose_tiles(1, 4096, 512, 132).split_k == 1  # two K tiles: too short to split


def test_the_backend_multiplies_packed_weights_with_the_kernel() -> None:
    """A projection holding a packed weight runs the Triton kernel; CPU blocks stay with the CPU kernels."""
    backend = TritonBackend()
    weight = _weight("q6_k", 24, 256, seed=4)
    assert backend.place_quantized(weight, torch.device("cpu")) is weight
    layer = Linear(256, 24, bias=True, backend=backend).to(DEVICE)
    layer.use_quantized(pack_for_device(weight, DEVICE))
    x = torch.randn(3, 256, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(layer(x).cpu().double(), _expected(x, weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert backend.quantized_formats(torch.device("cuda"), torch.bfloat16) == frozenset(FORMATS)
    assert backend.quantized_formats(torch.device("cpu"), torch.bfloat16) == frozenset()  # the CPU kernels: fp32
    with pytest.raises(TypeError, match="multiplies CPU blocks"):
        CpuBackend().quantized_linear(torch.randn(1, 256), pack_for_device(weight, "cpu"))


GPU_SHAPES = [(4096, 4096), (4096, 14336)]  # Llama-3-8B's o_proj, and down_proj (the longest K: split-K at decode)


@functools.cache
def _gpu_case(qtype: str, out_features: int, in_features: int) -> tuple[DeviceQuantizedWeight, torch.Tensor]:
    """The packed weight and its dequantized float32 twin on the GPU, quantized once for both dtypes."""
    weight = _weight(qtype, out_features, in_features, seed=out_features + in_features)
    return pack_for_device(weight, "cuda"), dequantize(weight).to("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs compiled Triton kernels on a CUDA device")
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_realistic_shapes_on_the_gpu(qtype: str, dtype: torch.dtype) -> None:
    """Decode (1 and 7 tokens: split-K), a small batch and prefill, against torch's float32 matmul with the
    dequantized weight rounded to x's dtype."""
    for out_features, in_features in GPU_SHAPES:
        packed, w = _gpu_case(qtype, out_features, in_features)
        for tokens in (1, 7, 48, 512):
            x = torch.randn(tokens, in_features, device="cuda", dtype=dtype)
            expected = x.float() @ w.to(dtype).float().T
            out = quantized_linear(x, packed)
            torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2, msg=f"{qtype} {tokens} tokens")
