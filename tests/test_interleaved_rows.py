"""Q4_0 and Q4_K with rows interleaved eight at a time (kernels/interleaved_rows.py, csrc/q4_0_rows8.c,
csrc/q4_k_rows8.c): the layouts against their torch reference, their 16-bit products against the reference of
that arithmetic (kernels/int8_reference.py) and the row-at-a-time kernels, and the engine laying a model's weights
out only where it pays."""

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
    INTERLEAVED,
    deinterleave_rows,
    interleave_reference,
    interleave_rows,
    rows8_kernel_built,
)
from pagedserve.kernels.quantized import (
    QuantizedWeight,
    dequantize,
    int8_linear_kernel,
    lookup_rows,
    quantize,
    quantized_linear,
)
from tests.test_cpu_decoder import generate, k_quant_sized_llama  # noqa: F401 (a fixture)
from tests.test_int8_activations import NARROWER_BUILDS, activations, assert_passes_on_build, integer_product
from tests.test_kernels_quantized import random_weight
from tests.test_kquants import q4_k_m_file  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
# Any count: tiles of four tokens (csrc/int8_linear.c's ROWS8_TOKENS), whole and cut short, and prefill's sizes.
TOKENS = (1, 2, 3, 4, 5, 8, 9, 17, 40)
QTYPES = tuple(INTERLEAVED)


def weight_of(qtype: str, out_features: int = 48, in_features: int = 768, seed: int = 4) -> QuantizedWeight:
    return quantize(random_weight(out_features, in_features, seed=seed), qtype)


def q4_0_weight(out_features: int = 48, in_features: int = 768) -> QuantizedWeight:
    return weight_of("q4_0", out_features, in_features)


@pytest.mark.parametrize("qtype", QTYPES)
def test_the_native_interleave_is_the_reference_and_reverses(qtype: str) -> None:
    weight = weight_of(qtype, out_features=24, in_features=512)
    laid_out = interleave_rows(weight)
    assert laid_out.qtype == INTERLEAVED[qtype] and laid_out.shape == weight.shape
    assert laid_out.blocks.data_ptr() != weight.blocks.data_ptr()
    assert torch.equal(laid_out.blocks, interleave_reference(weight.blocks, qtype))
    assert not torch.equal(laid_out.blocks, weight.blocks)
    assert torch.equal(deinterleave_rows(laid_out.blocks, laid_out.qtype), weight.blocks)
    assert torch.equal(dequantize(laid_out), dequantize(weight))  # every reader of the file's layout still can


def test_the_q4_0_layout_puts_each_rows_bytes_where_the_kernel_reads_them() -> None:
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


def test_the_q4_k_layout_puts_each_rows_bytes_where_the_kernel_reads_them() -> None:
    """Super-block 1 of group 0: d, dmin, the scales' three words, then chunk 16j + k = bytes 2k and 2k + 1 of
    each row's segment j of nibbles."""
    weight = weight_of("q4_k", out_features=16, in_features=512)
    super_block = interleave_rows(weight).blocks.flatten()[1152 : 2 * 1152]
    for r in range(8):
        row = weight.blocks[r, 144 : 2 * 144]
        assert torch.equal(super_block[2 * r : 2 * r + 2], row[0:2])
        assert torch.equal(super_block[16 + 2 * r : 18 + 2 * r], row[2:4])
        for word in range(3):
            at = 32 + 32 * word + 4 * r
            assert torch.equal(super_block[at : at + 4], row[4 + 4 * word : 8 + 4 * word])
        for j in range(4):
            for k in range(16):
                at = 128 + 16 * (16 * j + k) + 2 * r
                assert torch.equal(super_block[at : at + 2], row[16 + 32 * j + 2 * k : 18 + 32 * j + 2 * k])


@pytest.mark.parametrize("qtype_or_rows", [("q8_0", 16), ("q5_k", 16), ("q4_0", 12), ("q4_k", 4), ("q6_k", 12)])
def test_only_formats_with_a_layout_in_whole_groups_of_rows_interleave(qtype_or_rows: tuple[str, int]) -> None:
    qtype, rows = qtype_or_rows
    with pytest.raises(ValueError, match="interleave"):
        interleave_rows(quantize(random_weight(rows, 256, seed=1), qtype))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_the_interleaved_product_is_the_reference(qtype: str, tokens: int) -> None:
    """The arithmetic of the 16-bit product (x to 16 bits a block, exact integer dots, scaled once a block), as
    the row-at-a-time kernel computes it: the same to float32 rounding, on x with outliers and a zero block."""
    weight = weight_of(qtype)
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


@pytest.fixture
def model_of(tiny_model_dir: Callable[[str], Path], request: pytest.FixtureRequest) -> Callable[[str], str]:
    """A checkpoint whose projections `quantization=qtype` quantizes (K-quants need inputs of 256s)."""
    return lambda qtype: str(
        request.getfixturevalue("k_quant_sized_llama") if qtype.endswith("_k") else tiny_model_dir("llama")
    )


@pytest.mark.skipif(not rows8_kernel_built(), reason="the layouts pay only with the AVX2 kernels")
@pytest.mark.parametrize("qtype", QTYPES)
def test_the_engine_lays_projections_out_for_int16_alone_and_decodes_as_before(
    model_of: Callable[[str], str], qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int16 on a CPU whose tile unit does not take the format: every projection interleaved, greedy tokens those
    of the row-at-a-time kernels on the file's layout, logprobs within float32 rounding. float32: nothing
    re-laid."""
    config = EngineConfig(model=model_of(qtype), quantization=qtype, activation_dtype="int16")
    prompts = [list(range(100, 108)), list(range(300, 340)), list(range(1000, 1003))]
    monkeypatch.setattr(kernel_layouts, "tile_unit_takes", lambda qtype: False)
    laid_out = LLMEngine(config)
    assert projection_qtypes(laid_out) == {INTERLEAVED[qtype]}
    interleaved = generate(laid_out, prompts)
    monkeypatch.setattr(kernel_layouts, "interleaving_pays", lambda backend: False)
    as_stored = LLMEngine(config)
    assert projection_qtypes(as_stored) == {qtype}
    row_at_a_time = generate(as_stored, prompts)
    for i in interleaved:
        assert interleaved[i][0] == row_at_a_time[i][0]
        assert interleaved[i][1] == pytest.approx(row_at_a_time[i][1], abs=1e-4)
    monkeypatch.undo()
    float32 = LLMEngine(config.replace(activation_dtype="float32"))
    assert projection_qtypes(float32) == {qtype}
    assert lay_out_for_kernels(float32.runner.model, float32.runner.model.backend) == 0


def test_a_format_the_tile_unit_takes_keeps_the_files_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where AMX takes Q4_0 (it reads the file's layout), int16 leaves Q4_0 as stored and still lays Q4_K out."""
    monkeypatch.setattr(kernel_layouts, "tile_unit_takes", lambda qtype: qtype == "q4_0")
    q4_0, q4_k = weight_of("q4_0", in_features=256), weight_of("q4_k", in_features=256)
    assert kernel_layouts._interleaved(q4_0) is q4_0
    assert kernel_layouts._interleaved(q4_k).qtype == INTERLEAVED["q4_k"]


@pytest.mark.parametrize("qtype", QTYPES)
def test_lookups_in_an_interleaved_table_are_the_stored_tables(qtype: str) -> None:
    """A tied head laid out for its product is still the embedding: rows looked up in any order, repeated, from
    several groups of eight, equal those of the file's layout bit for bit."""
    table = weight_of(qtype, out_features=64, in_features=256)
    ids = torch.tensor([5, 0, 63, 5, 17, 8, 9])
    assert torch.equal(lookup_rows(interleave_rows(table), ids), lookup_rows(table, ids))


@pytest.mark.skipif(not rows8_kernel_built(), reason="the layouts pay only with the AVX2 kernels")
def test_a_q4_k_m_file_with_a_tied_head_decodes_as_before_once_laid_out(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q4_K and Q6_K parts of one fused q/k/v, and the tied Q6_K head the embedding looks rows up in: all laid
    out (the head and the embedding one copy), greedy tokens those of the file's layout. Logprobs within x's
    16-bit rounding: laid out, the 40-token prompt prefills on 16-bit activations too, where the file's layout
    prefills in float32."""
    config = EngineConfig(model=str(request.getfixturevalue("q4_k_m_file")), activation_dtype="int16")
    prompts = [list(range(100, 108)), list(range(300, 340)), list(range(1000, 1003))]
    laid_out = LLMEngine(config)
    model = laid_out.runner.model
    assert model.quantized_head.qtype == "q6_k_r8" and model.embed_tokens.table is model.quantized_head
    qkv = model.layers[0].self_attn.qkv_proj.quantized
    assert [part.qtype for part in qkv.parts] == ["q4_k_r8", "q4_k_r8", "q6_k_r8"]
    interleaved = generate(laid_out, prompts)
    monkeypatch.setattr(kernel_layouts, "interleaving_pays", lambda backend: False)
    as_stored = LLMEngine(config)
    assert as_stored.runner.model.quantized_head.qtype == "q6_k"
    row_at_a_time = generate(as_stored, prompts)
    for i in interleaved:
        assert interleaved[i][0] == row_at_a_time[i][0]
        assert interleaved[i][1] == pytest.approx(row_at_a_time[i][1], abs=2e-3)


@pytest.mark.parametrize("build", NARROWER_BUILDS)
def test_narrower_builds_interleave_and_multiply_as_the_reference(build: str) -> None:
    """This file's layout and product tests on the library built for AVX2 alone, then without AVX (the scalar
    tiles of csrc/q*_rows8.c, which a CPU without AVX2 would run; the engine lays nothing out there)."""
    assert_passes_on_build(__file__, "(reference or lookups or bytes_where) and not narrower", build)
