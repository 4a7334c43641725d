"""Q5_0, Q5_1, Q2_K and Q3_K: the torch reference against gguf-py on random blocks, the quantizers, the C kernels
against gguf-py's dequantization (as compiled for this host, and for AVX2 alone and for no AVX2 at all), the
embedding lookup, and a tiny Llama GGUF stored in these types served as stored, with the native decoder."""

from __future__ import annotations

import platform
import shutil
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.worker.model_loader import load_model
from pagedserve.kernels import cpu_native, quantized
from pagedserve.kernels.quantized import (
    FORMATS,
    QuantizedWeight,
    dequantize,
    dequantize_kernel,
    lookup_rows,
    quantize,
    quantized_linear,
)
from tests.test_cpu_decoder import PROMPTS, both_ways
from tests.test_kernels_quantized import assert_matches_product, random_weight
from tests.test_kquants import write_tiny_gguf

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
QTYPES = ["q5_0", "q5_1", "q2_k", "q3_k"]
SCALE_OFFSETS = {  # where each format keeps its fp16 scales
    **{"q5_0": (0,), "q5_1": (0, 2), "q2_k": (80, 82), "q3_k": (108,)},
    **{"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)},
}
TOKENS = (1, 3, 8, 11, 16, 40)  # the single-token kernel, register tiles (11: 8 and 3), float32 tiles from 16


def ggml_type(qtype: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[qtype.upper()]


def random_blocks(qtype: str, rows: int, in_features: int, seed: int) -> QuantizedWeight:
    """Random bytes, but with finite fp16 scales of a trained layer's size (random bytes there would hold
    infinities and NaNs, which gguf-py and torch need not agree on)."""
    fmt = FORMATS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, in_features // fmt.block_weights, fmt.block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        halves = (rng.standard_normal(blocks.shape[:2]) * 1e-3).astype(np.float16)
        blocks[..., offset : offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return QuantizedWeight.from_gguf(blocks.reshape(rows, -1), ggml_type(qtype), (rows, in_features))


def gguf_dequantized(weight: QuantizedWeight) -> torch.Tensor:
    """The oracle: gguf-py's reading of the blocks."""
    return torch.from_numpy(gguf.quants.dequantize(weight.blocks.numpy(), ggml_type(weight.qtype)))


# --- the torch reference and the quantizers ------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_is_gguf_bit_for_bit(qtype: str) -> None:
    weight = random_blocks(qtype, 64, 768, seed=1)
    assert torch.equal(dequantize(weight).view(torch.int32), gguf_dequantized(weight).view(torch.int32))


@pytest.mark.parametrize("qtype", ["q5_0", "q5_1"])
def test_quantize_writes_gguf_bytes(qtype: str) -> None:
    weight = random_weight(64, 1536, seed=2)
    expected = gguf.quants.quantize(weight.numpy(), ggml_type(qtype))
    np.testing.assert_array_equal(quantize(weight, qtype).blocks.numpy(), expected)


# Round to nearest: measured 4.3% (Q5_0), 3.8% (Q5_1), 33% (Q2_K: four levels a sub-block) and 16% (Q3_K) on
# these weights; the bounds leave room above that.
@pytest.mark.parametrize(("qtype", "bound"), [("q5_0", 0.06), ("q5_1", 0.06), ("q2_k", 0.4), ("q3_k", 0.2)])
def test_quantized_blocks_are_valid_and_close(qtype: str, bound: float) -> None:
    weight = random_weight(64, 1536, seed=3)
    blocks = quantize(weight, qtype)
    assert blocks.blocks.shape == (64, 1536 // FORMATS[qtype].block_weights * FORMATS[qtype].block_bytes)
    assert torch.equal(gguf_dequantized(blocks), dequantize(blocks))  # gguf-py reads the same
    assert (dequantize(blocks) - weight).norm() / weight.norm() < bound
    assert torch.equal(dequantize(blocks)[0, :32], torch.zeros(32))  # an all-zero block stays exactly zero


# --- the kernels against gguf-py -------------------------------------------------------------------------------


def check_kernels(qtype: str, out_features: int = 37, in_features: int = 768) -> None:
    """Dequantization bit for bit, the embedding lookup, and products at every token count, with a bias, in
    both layouts of x and of out."""
    weight = random_blocks(qtype, out_features, in_features, seed=4)
    expected = gguf_dequantized(weight)
    kernel = dequantize_kernel()
    assert kernel is not None
    assert torch.equal(kernel(weight.blocks, qtype).view(torch.int32), expected.view(torch.int32))
    ids = torch.tensor([5, 0, out_features - 1, 5])
    assert torch.equal(lookup_rows(weight, ids), expected[ids])
    generator = torch.Generator().manual_seed(5)
    for tokens in TOKENS:
        x, bias = torch.randn(tokens, in_features, generator=generator), torch.randn(out_features)
        assert_matches_product(quantized_linear(x, weight, bias), x, expected, bias)
        x_by_feature = torch.randn(in_features, tokens, generator=generator).t()
        out = torch.full((out_features, tokens), float("nan")).t()
        assert quantized_linear(x_by_feature, weight, bias, out=out) is out
        assert_matches_product(out, x_by_feature, expected, bias)


@needs_compiler
@pytest.mark.parametrize("qtype", QTYPES)
def test_kernels_match_gguf(qtype: str) -> None:
    check_kernels(qtype)


@needs_compiler
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("in_features", [256, 1536])
def test_one_token_on_one_and_many_blocks(qtype: str, in_features: int) -> None:
    """Rows of one super-block (the K-quants) or eight blocks, and x offset from zero, so that the mins' term
    (Q5_1, Q2_K) weighs in the sums."""
    weight = random_blocks(qtype, 7, in_features, seed=in_features)
    x, bias = torch.randn(1, in_features) + 0.5, torch.randn(7)
    assert_matches_product(quantized_linear(x, weight, bias), x, gguf_dequantized(weight), bias)


def _x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


@pytest.fixture(params=["haswell", "x86-64-v2"])
def other_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """The library built for another x86 CPU than this one: Haswell's AVX2 without AVX-512 (the AVX2
    intrinsics, and the vector code as AVX2 compiles it), and x86-64-v2 without AVX2 (the portable vector code)."""
    if not _x86() or shutil.which("cc") is None:
        pytest.skip("needs an x86 host with a C compiler")
    march = str(request.param)
    flags = tuple(f"-march={march}" if flag == "-march=native" else flag for flag in cpu_native.CFLAGS)
    monkeypatch.setattr(cpu_native, "CFLAGS", flags)
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE_DIR", str(tmp_path))
    cpu_native.forget_bound_kernels()
    try:
        yield march
        assert list(tmp_path.glob("*.so")), "the kernels should have come from the build for that CPU"
    finally:
        cpu_native.forget_bound_kernels()


def test_kernels_built_for_other_cpus(other_build: str) -> None:
    for qtype in SCALE_OFFSETS:  # the other formats too: their AVX2 and portable paths are tested nowhere else
        check_kernels(qtype, out_features=19, in_features=512)


@pytest.mark.parametrize("tokens", [1, 16])
def test_torch_path_without_native_kernels(monkeypatch: pytest.MonkeyPatch, tokens: int) -> None:
    monkeypatch.setattr(quantized, "quantized_linear_kernel", lambda: None)
    monkeypatch.setattr(quantized, "dequantize_kernel", lambda: None)
    for qtype in QTYPES:
        weight = random_blocks(qtype, 37, 512, seed=6)
        x, bias = torch.randn(tokens, 512), torch.randn(37)
        assert_matches_product(quantized_linear(x, weight, bias), x, gguf_dequantized(weight), bias)


# --- a GGUF file in these types, served as stored --------------------------------------------------------------

# Every projection in one of the four types (fused parts alike, so they stay blocks), the tied embedding too.
LOW_BIT_TYPES = {
    **{f"blk.0.attn_{part}": "Q5_0" for part in "qkv"},
    "blk.0.attn_output": "Q5_1",
    "blk.0.ffn_gate": "Q2_K",
    "blk.0.ffn_up": "Q2_K",
    "blk.0.ffn_down": "Q3_K",
    **{f"blk.1.attn_{part}": "Q3_K" for part in "qkv"},
    "blk.1.attn_output": "Q2_K",
    "blk.1.ffn_gate": "Q5_1",
    "blk.1.ffn_up": "Q5_1",
    "blk.1.ffn_down": "Q5_0",
    "token_embd": "Q3_K",
}
EXPECTED_QTYPES = {
    "layers.0.self_attn.qkv_proj": "q5_0",
    "layers.0.self_attn.o_proj": "q5_1",
    "layers.0.mlp.gate_up_proj": "q2_k",
    "layers.0.mlp.down_proj": "q3_k",
    "layers.1.self_attn.qkv_proj": "q3_k",
    "layers.1.self_attn.o_proj": "q2_k",
    "layers.1.mlp.gate_up_proj": "q5_1",
    "layers.1.mlp.down_proj": "q5_0",
}


@pytest.fixture(scope="module")
def low_bit_file(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("low-bits")
    path = folder / "tiny-low-bits.gguf"
    write_tiny_gguf(path, smol_dir, LOW_BIT_TYPES)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDSERVE_CACHE_DIR", str(folder / "cache"))
        yield path


@needs_compiler
def test_file_serves_as_stored_with_the_dequantized_models_tokens(low_bit_file: Path) -> None:
    stored = load_model(EngineConfig(model=str(low_bit_file)))
    modules = dict(stored.model.named_modules())
    assert {name: modules[name].quantized.qtype for name in EXPECTED_QTYPES} == EXPECTED_QTYPES
    assert stored.model.quantized_head is not None and stored.model.quantized_head.qtype == "q3_k"
    dequantized = load_model(EngineConfig(model=str(low_bit_file), quantization="none"))
    prompts = [list(range(100, 105)), list(range(300, 320)), list(range(1000, 1040))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def generate(loaded: object) -> list[list[int]]:
        config = EngineConfig(model=str(low_bit_file), num_kv_blocks=64, engine_process=False)
        with LLM.from_config(config, loaded) as llm:
            return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]

    expected = generate(dequantized)
    assert all(len(set(tokens)) > 3 for tokens in expected), "a model that repeats one token would test little"
    assert generate(stored) == expected


@needs_compiler
def test_native_decoder_takes_these_types(low_bit_file: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(low_bit_file)))
    native, modules = both_ways(engine, PROMPTS)
    for i in native:
        assert native[i][0] == modules[i][0]
        assert native[i][1] == pytest.approx(modules[i][1], abs=1e-4)
