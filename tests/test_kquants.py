"""K-quant weights (Q4_K, Q5_K, Q6_K): the torch reference against gguf-py, the quantizers, the C kernel against
the reference, and a tiny Llama written as a mixed Q4_K/Q6_K GGUF (as a Q4_K_M file is) served as stored."""

from __future__ import annotations

import functools
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.model_loader import LoadedModel, load_model
from pagedserve.engine.worker.models.layers import Linear
from pagedserve.engine.worker.weights.gguf import PART_MODULES
from pagedserve.kernels import quantized
from pagedserve.kernels.quantized import (
    FORMATS,
    QuantizedWeight,
    dequantize,
    dequantize_kernel,
    quantize,
    quantized_linear,
)
from pagedserve.kernels.stacked_weight import RowStackedWeight
from tests.gguf_writing import close_writer, new_writer, own_cache
from tests.test_kernels_quantized import assert_matches_reference, random_weight

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
QTYPES = ["q4_k", "q5_k", "q6_k"]
GGML_TYPES = {
    "q4_k": gguf.GGMLQuantizationType.Q4_K,
    "q5_k": gguf.GGMLQuantizationType.Q5_K,
    "q6_k": gguf.GGMLQuantizationType.Q6_K,
}
D_OFFSETS = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}  # where each format keeps its fp16 super-scales


def random_blocks(qtype: str, rows: int, in_features: int, seed: int) -> np.ndarray:
    """Random bytes [rows, row_bytes], but with finite fp16 super-scales of a trained layer's size (random bytes
    there would hold infinities and NaNs, which gguf-py and torch need not agree on)."""
    fmt = FORMATS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, in_features // 256, fmt.block_bytes), dtype=np.uint8)
    for offset in D_OFFSETS[qtype]:
        halves = (rng.standard_normal(blocks.shape[:2]) * 1e-3).astype(np.float16)
        blocks[..., offset : offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


@functools.cache
def quantized_random(qtype: str, out_features: int, in_features: int) -> QuantizedWeight:
    return quantize(random_weight(out_features, in_features), qtype)


# --- the torch reference against gguf-py, the quantizers ---------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_is_gguf_bit_for_bit(qtype: str) -> None:
    raw = random_blocks(qtype, 64, 768, seed=1)
    weight = QuantizedWeight.from_gguf(raw, GGML_TYPES[qtype], (64, 768))
    expected = gguf.quants.dequantize(raw, GGML_TYPES[qtype])
    np.testing.assert_array_equal(dequantize(weight).numpy().view(np.uint32), expected.view(np.uint32))


# Rounding to nearest on a grid of 15 (Q4_K), 31 (Q5_K) or ~63 (Q6_K) steps, with 6- or 8-bit sub-block scales:
# measured 7.8%, 3.8% and 1.9% on these weights; the bounds leave room above that.
@pytest.mark.parametrize(("qtype", "bound"), [("q4_k", 0.1), ("q5_k", 0.05), ("q6_k", 0.03)])
def test_quantized_blocks_are_valid_and_close(qtype: str, bound: float) -> None:
    weight = random_weight(64, 1536, seed=3)
    blocks = quantize(weight, qtype)
    assert blocks.blocks.shape == (64, 6 * FORMATS[qtype].block_bytes)
    read_back = gguf.quants.dequantize(blocks.blocks.numpy(), GGML_TYPES[qtype])  # gguf-py reads the same
    np.testing.assert_array_equal(read_back, dequantize(blocks).numpy())
    assert (dequantize(blocks) - weight).norm() / weight.norm() < bound
    assert torch.equal(dequantize(blocks)[0, :32], torch.zeros(32))  # an all-zero sub-block stays exactly zero


@pytest.mark.parametrize("qtype", QTYPES)
def test_in_features_must_be_whole_super_blocks(qtype: str) -> None:
    with pytest.raises(ValueError, match="multiple of the 256-weight block"):
        quantize(torch.randn(8, 576), qtype)
    with pytest.raises(ValueError, match="multiple of the 256-weight block"):
        QuantizedWeight.from_gguf(np.zeros(8 * 2 * 210, np.uint8), GGML_TYPES[qtype], (8, 544))
    with pytest.raises(ValueError, match="ggml type 35 is not one of"):
        QuantizedWeight.from_gguf(np.zeros(8 * 66, np.uint8), gguf.GGMLQuantizationType.TQ2_0, (8, 256))


# --- the kernel against the reference -----------------------------------------------------------------------


@needs_compiler
@pytest.mark.parametrize("qtype", QTYPES)
def test_native_dequantize_is_the_reference_bit_for_bit(qtype: str) -> None:
    weight = QuantizedWeight.from_gguf(random_blocks(qtype, 37, 1536, seed=4), qtype, (37, 1536))
    native = dequantize_kernel()(weight.blocks, qtype)
    assert torch.equal(native.view(torch.int32), dequantize(weight).view(torch.int32))


@needs_compiler
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 17, 48, 100, 140])  # 100, 140: several blocks of tokens
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 256), (193, 1536)])
def test_matches_reference(qtype: str, tokens: int, out_features: int, in_features: int) -> None:
    weight = quantized_random(qtype, out_features, in_features)
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(tokens))
    assert_matches_reference(quantized_linear(x, weight), x, weight)


@needs_compiler
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 140])
def test_bias_and_layouts(qtype: str, tokens: int) -> None:
    """Feature-major x and out (the CPU backend's layouts for small batches), and a bias."""
    weight = quantized_random(qtype, 193, 512)
    x, bias = torch.randn(512, tokens).t(), torch.randn(193)
    out = torch.full((193, tokens), float("nan")).t()
    assert quantized_linear(x, weight, bias, out=out) is out
    assert_matches_reference(out, x, weight, bias)


@needs_compiler
def test_random_blocks_multiply_as_dequantized() -> None:
    """Random bit patterns of scales and q, not only the ones the quantizers write."""
    for qtype in QTYPES:
        weight = QuantizedWeight.from_gguf(random_blocks(qtype, 65, 768, seed=5), qtype, (65, 768))
        for tokens in (1, 3, 9):
            x = torch.randn(tokens, 768)
            assert_matches_reference(quantized_linear(x, weight), x, weight)


@pytest.mark.parametrize("tokens", [1, 16, 140])
def test_torch_path_without_native_kernels(monkeypatch: pytest.MonkeyPatch, tokens: int) -> None:
    monkeypatch.setattr(quantized, "quantized_linear_kernel", lambda: None)
    monkeypatch.setattr(quantized, "dequantize_kernel", lambda: None)
    for qtype in QTYPES:
        weight = quantized_random(qtype, 193, 512)
        x, bias = torch.randn(tokens, 512), torch.randn(193)
        assert_matches_reference(quantized_linear(x, weight, bias), x, weight, bias)


# --- a Q4_K_M-style GGUF file, served ----------------------------------------------------------------------

TINY = dict(
    hidden_size=256,  # whole super-blocks: K-quants need in_features % 256 == 0
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    vocab_size=4096,  # the first tokens of SmolLM2's tokenizer (add_tokenizer)
    rms_norm_eps=1e-5,
    initializer_range=0.1,  # varied greedy tokens (0.02 repeats one token)
    tie_word_embeddings=True,
)
# Each tensor's type, as llama.cpp's Q4_K_M mixes them: Q6_K for some v and down projections and the tied
# embedding, Q4_K for the rest; plus a Q5_K pair and a TQ2_0 tensor, which has no kernel.
TENSOR_TYPES = {
    "blk.0.attn_v": "Q6_K",  # q and k are Q4_K: the fused qkv mixes types, multiplied as three products
    "blk.0.ffn_down": "Q6_K",
    "blk.1.ffn_gate": "Q5_K",
    "blk.1.ffn_up": "Q5_K",
    "blk.1.attn_output": "TQ2_0",
    "token_embd": "Q6_K",
}
HF_NAMES = {**PART_MODULES, "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
EXPECTED_QTYPES = {  # our projections as stored blocks; the others stay float
    "layers.0.self_attn.o_proj": "q4_k",
    "layers.0.mlp.gate_up_proj": "q4_k",
    "layers.0.mlp.down_proj": "q6_k",
    "layers.1.self_attn.qkv_proj": "q4_k",
    "layers.1.mlp.gate_up_proj": "q5_k",
    "layers.1.mlp.down_proj": "q4_k",
    "lm_head": "q6_k",
}


def tiny_llama_tensors() -> dict[str, np.ndarray]:
    """A tiny random Llama's weights by GGUF name (float32). The q/k rows stay in transformers' order: the file
    is read back by transformers and by us alike, and both un-permute them the same way."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    tensors = {"token_embd": state["model.embed_tokens.weight"], "output_norm": state["model.norm.weight"]}
    for layer in range(TINY["num_hidden_layers"]):
        for gguf_name, hf_name in HF_NAMES.items():
            tensors[f"blk.{layer}.{gguf_name}"] = state[f"model.layers.{layer}.{hf_name}.weight"]
    return tensors


def encoded(name: str, weight: np.ndarray, types: dict[str, str]) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """A tensor's bytes in its type: norms in float32, the rest as `types` says (Q4_K by default)."""
    if weight.ndim == 1:
        return weight, gguf.GGMLQuantizationType.F32
    qtype = gguf.GGMLQuantizationType[types.get(name, "Q4_K")]
    if qtype.name.lower() in FORMATS:
        return quantize(torch.from_numpy(weight), qtype.name.lower()).blocks.numpy(), qtype
    return gguf.quants.quantize(weight, qtype), qtype


def write_tiny_gguf(path: Path, smol_dir: Path, types: dict[str, str] = TENSOR_TYPES) -> None:
    writer = new_writer(path, "llama", transformers.LlamaConfig(**TINY), smol_dir)
    writer.add_rope_dimension_count(TINY["hidden_size"] // TINY["num_attention_heads"])
    for name, weight in tiny_llama_tensors().items():
        data, qtype = encoded(name, weight, types)
        writer.add_tensor(f"{name}.weight", data, raw_dtype=qtype)
    close_writer(writer)


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Iterator[Path]:
    """The tiny GGUF, converted into a cache folder of this module's own (not the user's)."""
    folder = tmp_path_factory.mktemp("q4_k_m")
    path = folder / "tiny-q4_k_m.gguf"
    write_tiny_gguf(path, smol_dir)
    with own_cache(folder):
        yield path


@pytest.fixture(scope="module")
def stored_and_float(q4_k_m_file: Path) -> tuple[LoadedModel, LoadedModel]:
    stored = load_model(EngineConfig(model=str(q4_k_m_file)))
    return stored, load_model(EngineConfig(model=str(q4_k_m_file), quantization="none"))


def test_the_file_is_read_in_its_stored_formats(q4_k_m_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.worker.weights.gguf"):
        stored = load_model(EngineConfig(model=str(q4_k_m_file)))
    dequantized = load_model(EngineConfig(model=str(q4_k_m_file), quantization="none"))
    modules, float_modules = dict(stored.model.named_modules()), dict(dequantized.model.named_modules())
    for name, qtype in EXPECTED_QTYPES.items():
        block = stored.model.quantized_head if name == "lm_head" else modules[name].quantized
        assert isinstance(block, QuantizedWeight) and block.qtype == qtype, name
        twin = dequantized.model.embed_tokens if name == "lm_head" else float_modules[name]
        assert torch.equal(dequantize(block), twin.weight.data), name  # fused and un-permuted, bit for bit
    mixed = modules["layers.0.self_attn.qkv_proj"].quantized  # q and k in Q4_K, v in Q6_K: separate products
    assert isinstance(mixed, RowStackedWeight) and [p.qtype for p in mixed.parts] == ["q4_k", "q4_k", "q6_k"]
    rows = torch.cat([dequantize(part) for part in mixed.parts])
    assert torch.equal(rows, float_modules["layers.0.self_attn.qkv_proj"].weight.data)
    x = torch.randn(3, TINY["hidden_size"])
    expected = x @ rows.T
    torch.testing.assert_close(modules["layers.0.self_attn.qkv_proj"](x).contiguous(), expected, rtol=1e-4, atol=1e-4)
    without_kernel = modules["layers.1.self_attn.o_proj"]  # TQ2_0: dequantized alone, no kernel reads it
    assert isinstance(without_kernel, Linear) and without_kernel.quantized is None
    assert torch.equal(without_kernel.weight.data, float_modules["layers.1.self_attn.o_proj"].weight.data)
    [line] = [r.getMessage() for r in caplog.records if "multiply in float" in r.getMessage()]
    assert "TQ2_0: layers.1.self_attn.o_proj" in line


def test_greedy_tokens_equal_the_dequantized_models(stored_and_float: tuple[LoadedModel, LoadedModel]) -> None:
    """A request alone (one-token decode steps), then four at once (few-token steps, and a prefill of several
    blocks of tokens), through the offline API."""
    prompts = [list(range(100, 105)), list(range(300, 320)), list(range(1000, 1140)), [17, 2424, 999]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def generate(loaded: LoadedModel) -> list[list[int]]:
        config = EngineConfig(
            model=str(loaded.model_dir), num_kv_blocks=64, engine_process=False, activation_dtype="float32"
        )
        with LLM.from_config(config, loaded) as llm:
            alone = llm.generate(prompts[:1], params, use_tqdm=False)
            together = llm.generate(prompts, params, use_tqdm=False)
            return [out.outputs[0].token_ids for out in alone + together]

    stored, dequantized = stored_and_float
    expected = generate(dequantized)
    assert all(len(set(tokens)) > 4 for tokens in expected), "a model that repeats one token would test little"
    assert generate(stored) == expected


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantization_on_load(stored_and_float: tuple[LoadedModel, LoadedModel], qtype: str) -> None:
    """`quantization: q4_k` (and the others) quantizes every projection at load; each then multiplies as the
    blocks its quantizer wrote."""
    float_model = stored_and_float[1]
    loaded = load_model(EngineConfig(model=str(float_model.model_dir), quantization=qtype))
    pairs = [
        (twin, module)
        for twin, module in zip(loaded.model.modules(), float_model.model.modules(), strict=True)
        if isinstance(module, Linear)
    ]
    assert pairs and all(twin.quantized is not None and twin.quantized.qtype == qtype for twin, _ in pairs)
    for twin, module in pairs:
        x = torch.randn(3, module.in_features)
        expected = x @ dequantize(quantize(module.weight.data, qtype)).T
        torch.testing.assert_close(twin(x).contiguous(), expected, rtol=1e-4, atol=1e-4)
