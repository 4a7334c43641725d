"""Linear layers on ggml-quantized weights (kernels/quantized.py): the torch reference against gguf-py, the C
kernel against the reference, on random weights and on the embedded model's own tensors."""

from __future__ import annotations

import functools
import shutil

import gguf
import numpy as np
import pytest
import torch

from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path
from pagedserve.kernels import quantized
from pagedserve.kernels.quantized import (
    QuantizedWeight,
    dequantize,
    dequantize_kernel,
    quantize,
    quantized_linear,
    quantized_linear_kernel,
)

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
QTYPES = ["q8_0", "q4_0", "q4_1"]
GGML_TYPES = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
}
# SmolLM2's projection widths; token counts around the kernel's 8-token tile, its float32 tiles from 16 tokens,
# and past one block of 64 tokens (csrc/dequantized_tiles.c walks the tokens in blocks).
FEATURES_IN, FEATURES_OUT = (576, 1536), (192, 576, 1536)
TOKENS = (1, 2, 3, 7, 16, 33, 100)


def random_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Weights of a trained layer's scale, with a few blocks that stress the quantizers: all zero, constant,
    and one whose largest magnitude is negative."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    weight[0, :32] = 0.0
    weight[0, 32:64] = 0.25
    weight[0, 64:96] = torch.linspace(-1.0, 0.5, 32)
    return weight


@functools.cache
def quantized_random(qtype: str, out_features: int, in_features: int) -> QuantizedWeight:
    return quantize(random_weight(out_features, in_features), qtype)


def assert_matches_reference(
    out: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> None:
    assert_matches_product(out, x, dequantize(weight), bias)


def assert_matches_product(
    out: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """Within float32 rounding of x @ dense^T + bias: the sums run in another order, and their rounding grows
    with the length of the dot products (SmolLM2's hidden size, 576, as the unit)."""
    expected = torch.nn.functional.linear(x, dense, bias)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * dense.shape[1] / 576)


# --- the torch reference against gguf-py ----------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_is_gguf_bit_for_bit(qtype: str) -> None:
    raw = gguf.quants.quantize(random_weight(64, 576, seed=1).numpy(), GGML_TYPES[qtype])
    weight = QuantizedWeight.from_gguf(raw, GGML_TYPES[qtype], (64, 576))
    expected = gguf.quants.dequantize(raw, GGML_TYPES[qtype])
    np.testing.assert_array_equal(dequantize(weight).numpy().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantize_writes_gguf_bytes(qtype: str) -> None:
    weight = random_weight(64, 1536, seed=2)
    expected = gguf.quants.quantize(weight.numpy(), GGML_TYPES[qtype])
    np.testing.assert_array_equal(quantize(weight, qtype).blocks.numpy(), expected)


# Round to nearest: the error is uniform over a step, step / sqrt(12) in RMS, which is ~0.5% of a Gaussian
# block's spread at 8 bits and 7-8% at 4; the bounds leave room above that.
@pytest.mark.parametrize(("qtype", "bound"), [("q8_0", 0.01), ("q4_0", 0.12), ("q4_1", 0.12)])
def test_quantization_error(qtype: str, bound: float) -> None:
    weight = random_weight(64, 576, seed=3)
    error = dequantize(quantize(weight, qtype)) - weight
    assert error.norm() / weight.norm() < bound


@pytest.mark.parametrize("qtype", QTYPES)
def test_sizes(qtype: str) -> None:
    weight = quantized_random(qtype, 192, 576)
    block_bytes = {"q8_0": 34, "q4_0": 18, "q4_1": 20}[qtype]
    assert weight.shape == (192, 576) and weight.blocks.shape == (192, 18 * block_bytes)
    assert weight.nbytes == 192 * 18 * block_bytes


# --- the kernel against the reference -----------------------------------------------------------------------


@needs_compiler
def test_kernels_build() -> None:
    assert quantized_linear_kernel() is not None, "the kernel must build wherever a C compiler is installed"
    assert dequantize_kernel() is not None


@needs_compiler
@pytest.mark.parametrize("qtype", QTYPES)
def test_native_dequantize_is_the_reference_bit_for_bit(qtype: str) -> None:
    weight = quantized_random(qtype, 576, 1536)
    native = dequantize_kernel()(weight.blocks, qtype)
    assert torch.equal(native.view(torch.int32), dequantize(weight).view(torch.int32))


@needs_compiler
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("in_features", FEATURES_IN)
@pytest.mark.parametrize("out_features", FEATURES_OUT)
def test_matches_reference(qtype: str, tokens: int, in_features: int, out_features: int) -> None:
    weight = quantized_random(qtype, out_features, in_features)
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(tokens))
    assert_matches_reference(quantized_linear(x, weight), x, weight)


@needs_compiler
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("tokens", [1, 9, 100])
def test_bias(qtype: str, tokens: int) -> None:
    weight = quantized_random(qtype, 576, 576)
    x, bias = torch.randn(tokens, 576), torch.randn(576)
    assert_matches_reference(quantized_linear(x, weight, bias), x, weight, bias)


@needs_compiler
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 32), (7, 32), (5, 64), (3, 96)])
def test_one_token_small_shapes(qtype: str, out_features: int, in_features: int) -> None:
    """One token (the kernel's own path, row_single) on rows of one to three blocks, and odd row counts."""
    weight = quantize(random_weight(out_features, 96, seed=out_features)[:, :in_features].contiguous(), qtype)
    x, bias = torch.randn(1, in_features) + 0.5, torch.randn(out_features)
    assert_matches_reference(quantized_linear(x, weight, bias), x, weight, bias)


@needs_compiler
@pytest.mark.parametrize("tokens", [1, 5, 16, 100])
def test_layouts(tokens: int) -> None:
    """Feature-major x (the CPU backend's layout for small batches) is read correctly, and `out` may be
    feature-major too: the kernel writes through its strides."""
    weight = quantized_random("q4_1", 192, 576)
    x = torch.randn(576, tokens).t()
    out = torch.full((192, tokens), float("nan")).t()
    assert quantized_linear(x, weight, out=out) is out
    assert_matches_reference(out, x, weight)
    x_in_wider_rows = torch.randn(tokens, 640)[:, :576]
    assert_matches_reference(quantized_linear(x_in_wider_rows, weight), x_in_wider_rows, weight)


@needs_compiler
@needs_compiler
@pytest.mark.parametrize("qtype", QTYPES)
def test_wide_inputs_take_smaller_blocks_of_tokens(qtype: str) -> None:
    """8192 input features: blocks of 16 tokens keep their activations in L2; 50 tokens end on a partial one."""
    weight = quantized_random(qtype, 37, 8192)
    x = torch.randn(50, 8192, generator=torch.Generator().manual_seed(5))
    assert_matches_reference(quantized_linear(x, weight), x, weight)


def test_no_tokens() -> None:
    assert quantized_linear(torch.randn(0, 576), quantized_random("q4_1", 192, 576)).shape == (0, 192)


@pytest.mark.parametrize("tokens", [1, 16, 100])
def test_torch_path_without_native_kernels(monkeypatch: pytest.MonkeyPatch, tokens: int) -> None:
    monkeypatch.setattr(quantized, "quantized_linear_kernel", lambda: None)
    monkeypatch.setattr(quantized, "dequantize_kernel", lambda: None)
    weight = quantized_random("q4_0", 576, 576)
    x, bias = torch.randn(tokens, 576), torch.randn(576)
    assert_matches_reference(quantized_linear(x, weight, bias), x, weight, bias)


def test_gradients_flow_through_the_torch_path() -> None:
    weight = quantized_random("q8_0", 192, 576)
    x = torch.randn(3, 576, requires_grad=True)
    quantized_linear(x, weight).sum().backward()
    torch.testing.assert_close(x.grad, dequantize(weight).sum(0).expand(3, -1))


# --- the embedded model's own tensors -----------------------------------------------------------------------


@functools.cache
def embedded_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(embedded_gguf_path())  # seconds to parse: once for all the tests


def embedded_weight(name: str) -> tuple[QuantizedWeight, np.ndarray]:
    """A tensor of the embedded SmolLM2 GGUF as a QuantizedWeight, and gguf-py's dequantization of it."""
    tensor = next(t for t in embedded_reader().tensors if t.name == name)
    shape = tuple(reversed(tensor.shape.tolist()))  # GGUF lists dimensions innermost first
    weight = QuantizedWeight.from_gguf(tensor.data, tensor.tensor_type, shape)
    return weight, gguf.quants.dequantize(tensor.data, tensor.tensor_type)


@needs_compiler
@pytest.mark.parametrize(
    ("name", "qtype", "shape"),
    [
        ("blk.0.attn_q.weight", "q4_1", (576, 576)),
        ("blk.7.ffn_down.weight", "q4_1", (576, 1536)),
        ("token_embd.weight", "q8_0", (49152, 576)),  # also the tied LM head
    ],
)
def test_embedded_model_tensors(name: str, qtype: str, shape: tuple[int, int]) -> None:
    weight, expected = embedded_weight(name)
    assert (weight.qtype, weight.shape) == (qtype, shape)
    np.testing.assert_array_equal(dequantize(weight).numpy().view(np.uint32), expected.view(np.uint32))
    for tokens in (1, 4, 60):
        x = torch.randn(tokens, shape[1])
        assert_matches_product(quantized_linear(x, weight), x, torch.from_numpy(expected))


# --- what is refused ------------------------------------------------------------------------------------------


def test_bad_weights_are_refused() -> None:
    raw = np.zeros(192 * 18 * 20, dtype=np.uint8)
    with pytest.raises(ValueError, match="multiple of the 32-weight block"):
        QuantizedWeight.from_gguf(raw, "q4_1", (192, 570))
    with pytest.raises(ValueError, match=r"takes 69120 bytes, got 69119"):
        QuantizedWeight.from_gguf(raw[:-1], "q4_1", (192, 576))
    with pytest.raises(ValueError, match="unknown quantization type 'iq4_nl'"):
        QuantizedWeight.from_gguf(raw, "iq4_nl", (192, 576))
    with pytest.raises(ValueError, match="ggml type 20 is not one of"):
        QuantizedWeight.from_gguf(raw, gguf.GGMLQuantizationType.IQ4_NL, (192, 576))
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight.from_gguf(raw.view(np.int8), "q4_1", (192, 576))
    with pytest.raises(ValueError, match=r"192 rows of 360 bytes, got blocks of shape \(192, 361\)"):
        QuantizedWeight("q4_1", torch.zeros(192, 361, dtype=torch.uint8), (192, 576))
    with pytest.raises(ValueError, match="multiple of the 32-weight block"):
        quantize(torch.randn(8, 100), "q8_0")


def test_bad_operands_are_refused() -> None:
    weight = quantized_random("q4_1", 192, 576)
    cases = [
        ({"x": torch.randn(2, 512)}, r"x must be \[tokens, 576\]"),
        ({"x": torch.randn(2, 576, dtype=torch.float64)}, "x must be a float32 CPU tensor"),
        ({"bias": torch.randn(191)}, r"bias must be a float32 CPU \[192\] vector"),
        ({"out": torch.empty(2, 191)}, r"out must be float32 \[2, 192\]"),
        ({"out": torch.empty(2, 384)[:, ::2]}, "one of its strides 1"),
    ]
    for overrides, message in cases:
        arguments = {"x": torch.randn(2, 576), "bias": None, "out": None, **overrides}
        with pytest.raises(ValueError, match=message):
            quantized_linear(arguments["x"], weight, arguments["bias"], out=arguments["out"])
