"""Q4_0 with rows interleaved eight at a time (kernels/interleaved_rows.py, csrc/q4_0_rows8.c): the layout against
its torch reference, its 16-bit product against the reference of that arithmetic (kernels/int8_reference.py) and
the row-at-a-time kernel, and the engine laying a model's weights out only where it pays."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.worker import kernel_layouts
from pagedserve.engine.worker.kernel_layouts import lay_out_for_kernels
from pagedserve.engine.worker.models.layers import Linear
from pagedserve.kernels.int8_reference import int8_linear_reference
from pagedserve.kernels.interleaved_rows import (
    ROWS8,
    deinterleave_rows,
    interleave_reference,
    interleave_rows,
    rows8_kernel_built,
)
from pagedserve.kernels.quantized import dequantize, int8_linear_kernel, quantize, quantized_linear
from tests.test_cpu_decoder import generate
from tests.test_int8_activations import activations, integer_product
from tests.test_kernels_quantized import random_weight

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
# Any count: tiles of four tokens (csrc/int8_linear.c's ROWS8_TOKENS), whole and cut short, and prefill's sizes.
TOKENS = (1, 2, 3, 4, 5, 8, 9, 17, 40)


def q4_0_weight(out_features: int = 48, in_features: int = 768, seed: int = 4) -> torch.Tensor:
    return quantize(random_weight(out_features, in_features, seed=seed), "q4_0")


def test_the_native_interleave_is_the_reference_and_reverses() -> None:
    weight = q4_0_weight(out_features=24, in_features=96)
    laid_out = interleave_rows(weight)
    assert laid_out.qtype == ROWS8 and laid_out.shape == weight.shape
    assert laid_out.blocks.data_ptr() != weight.blocks.data_ptr()
    assert torch.equal(laid_out.blocks, interleave_reference(weight.blocks))
    assert not torch.equal(laid_out.blocks, weight.blocks)
    assert torch.equal(deinterleave_rows(laid_out.blocks), weight.blocks)
    assert torch.equal(dequantize(laid_out), dequantize(weight))  # every reader of the file's layout still can


def test_the_layout_puts_each_rows_bytes_where_the_kernel_reads_them() -> None:
    """Group 0, block 1: the eight rows' scales first, then chunk k = bytes 2k and 2k + 1 of each row's nibbles."""
    weight = q4_0_weight(out_features=16, in_features=128)
    laid_out = interleave_rows(weight).blocks.flatten()
    rows = weight.blocks
    group_block = laid_out[144 : 2 * 144]
    for r in range(8):
        assert torch.equal(group_block[2 * r : 2 * r + 2], rows[r, 18 : 18 + 2])
        for k in range(8):
            at = 16 + 16 * k + 2 * r
            assert torch.equal(group_block[at : at + 2], rows[r, 18 + 2 + 2 * k : 18 + 4 + 2 * k])


@pytest.mark.parametrize("qtype_or_rows", [("q8_0", 16), ("q4_0", 12)])
def test_only_q4_0_in_whole_groups_of_rows_interleaves(qtype_or_rows: tuple[str, int]) -> None:
    qtype, rows = qtype_or_rows
    with pytest.raises(ValueError, match="interleave"):
        interleave_rows(quantize(random_weight(rows, 128, seed=1), qtype))


@pytest.mark.parametrize("tokens", TOKENS)
def test_the_interleaved_product_is_the_reference(tokens: int) -> None:
    """The arithmetic of the 16-bit product (x to 16 bits a block, exact integer dots, scaled once a block), as
    the row-at-a-time kernel computes it: the same to float32 rounding, on x with outliers and a zero block."""
    weight = q4_0_weight()
    x, bias = activations(tokens), torch.randn(48)
    out = quantized_linear(x, interleave_rows(weight), bias, activation_dtype="int16")
    expected = int8_linear_reference(x, weight, bias, bits=16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    row_at_a_time = integer_product(x, weight, bias, bits=16)
    torch.testing.assert_close(out, row_at_a_time, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_the_interleaved_product_writes_either_layout_and_reads_feature_major_x() -> None:
    weight = interleave_rows(q4_0_weight())
    x = activations(5).T.contiguous().T  # feature-major
    feature_major_out = torch.empty(48, 5).T
    quantized_linear(x, weight, out=feature_major_out, activation_dtype="int16")
    expected = int8_linear_reference(x, q4_0_weight(), bits=16)
    torch.testing.assert_close(feature_major_out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("dtype", ["float32", "int8", "int16"])
def test_the_layout_is_multiplied_by_16_bit_tokens_whatever_the_setting(dtype: str) -> None:
    """Only the 16-bit product reads the layout, so every token count and activation dtype take it; the 8-bit
    kernel refuses it rather than misread it."""
    weight, x = interleave_rows(q4_0_weight()), activations(20)
    out = quantized_linear(x, weight, activation_dtype=dtype)
    torch.testing.assert_close(out, int8_linear_reference(x, q4_0_weight(), bits=16), rtol=1e-5, atol=1e-3)
    int8 = int8_linear_kernel(sixteen_bits=False)
    assert int8 is not None
    with pytest.raises(ValueError, match="refused"):
        int8(x, weight, None, torch.empty(20, 48))


def projection_qtypes(engine: LLMEngine) -> set[str]:
    return {m.quantized.qtype for m in engine.runner.model.modules() if isinstance(m, Linear) and m.quantized}


@pytest.mark.skipif(not rows8_kernel_built(), reason="the layout pays only with the AVX2 kernel")
def test_the_engine_lays_q4_0_out_for_int16_alone_and_decodes_as_before(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """int16 on a CPU without AMX's tile unit: every Q4_0 projection interleaved, greedy tokens those of the
    row-at-a-time kernels on the file's layout, logprobs within float32 rounding. float32: nothing re-laid."""
    model = str(tiny_model_dir("llama"))
    prompts = [list(range(100, 108)), list(range(300, 340)), list(range(1000, 1003))]
    monkeypatch.setattr(kernel_layouts, "tile_unit_takes", lambda qtype: False)
    laid_out = LLMEngine(EngineConfig(model=model, quantization="q4_0", activation_dtype="int16"))
    assert projection_qtypes(laid_out) == {ROWS8}
    interleaved = generate(laid_out, prompts)
    monkeypatch.setattr(kernel_layouts, "interleaving_pays", lambda backend: False)
    as_stored = LLMEngine(EngineConfig(model=model, quantization="q4_0", activation_dtype="int16"))
    assert projection_qtypes(as_stored) == {"q4_0"}
    row_at_a_time = generate(as_stored, prompts)
    for i in interleaved:
        assert interleaved[i][0] == row_at_a_time[i][0]
        assert interleaved[i][1] == pytest.approx(row_at_a_time[i][1], abs=1e-4)
    monkeypatch.undo()
    float32 = LLMEngine(EngineConfig(model=model, quantization="q4_0", activation_dtype="float32"))
    assert projection_qtypes(float32) == {"q4_0"}
    assert lay_out_for_kernels(float32.runner.model, float32.runner.model.backend) == 0


def test_the_tile_unit_keeps_the_files_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where AMX takes Q4_0 (it reads the file's layout), int16 lays nothing out."""

    class Backend:
        activation_dtype = "int16"

    monkeypatch.setattr(kernel_layouts, "tile_unit_takes", lambda qtype: qtype == "q4_0")
    assert not kernel_layouts.interleaving_pays(Backend())  # type: ignore[arg-type]
    monkeypatch.setattr(kernel_layouts, "tile_unit_takes", lambda qtype: False)
    assert kernel_layouts.interleaving_pays(Backend()) == rows8_kernel_built()  # type: ignore[arg-type]
