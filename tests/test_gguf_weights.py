"""A GGUF checkpoint's projections kept in their stored blocks: the same weights and tokens as dequantized."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedserve.engine import SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.worker.model_loader import LoadedModel, _formats_multiplied_here, load_model
from pagedserve.engine.worker.models.layers import Linear, QuantizedEmbedding
from pagedserve.engine.worker.weights.gguf import BLOCKS_FILE, gguf_source, read_quantized_weights, stored_blocks
from pagedserve.kernels.quantized import FORMATS, dequantize, quantize
from tests.test_engine import run


@pytest.fixture(scope="module")
def float_loaded(smol_dir: Path) -> LoadedModel:
    return load_model(EngineConfig(model=str(smol_dir), quantization="none"))


def test_stored_blocks_are_the_dequantized_weights(float_loaded: LoadedModel, tmp_path: Path) -> None:
    source = gguf_source(float_loaded.model_dir)
    assert source is not None and source.suffix == ".gguf"
    weights = read_quantized_weights(source, float_loaded.spec)
    params = dict(float_loaded.model.named_parameters())
    assert len(weights) == 4 * float_loaded.spec.num_layers + 1  # qkv, o, gate/up, down per layer; the head
    for name, weight in weights.items():
        expected = params["embed_tokens.weight" if name == "lm_head" else f"{name}.weight"]
        assert torch.equal(dequantize(weight), expected.data), name  # fused and un-permuted as transformers does
    saved = stored_blocks(tmp_path, source, float_loaded.spec)
    assert (tmp_path / BLOCKS_FILE).exists()
    again = stored_blocks(tmp_path, source, float_loaded.spec)  # from the saved copy now
    for name, weight in saved.items():
        assert again[name].qtype == weight.qtype and again[name].shape == weight.shape
        assert torch.equal(again[name].blocks, weight.blocks)


def test_the_embedded_model_multiplies_by_its_stored_blocks(smol_loaded: LoadedModel) -> None:
    projections = [m for m in smol_loaded.model.modules() if isinstance(m, Linear)]
    assert projections and all(m.quantized is not None and m.weight.numel() == 0 for m in projections)
    assert smol_loaded.model.quantized_head is not None and smol_loaded.model.quantized_head.qtype == "q8_0"
    assert {m.quantized.qtype for m in projections if m.quantized is not None} == {"q4_1"}


def test_greedy_tokens_equal_the_dequantized_models(smol_loaded: LoadedModel, float_loaded: LoadedModel) -> None:
    prompts = {
        "short": (float_loaded.tokenizer.encode("The capital of France is"), 24),
        "chunked": (float_loaded.tokenizer.encode("Count to twenty: one, two, three, " * 12), 24),  # > 48 tokens
    }

    def generate(loaded: LoadedModel) -> dict[str, dict]:
        engine = LLMEngine(
            EngineConfig(model=str(loaded.model_dir), num_kv_blocks=64, activation_dtype="float32"), loaded=loaded
        )
        params = {
            name: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for name, (_, n) in prompts.items()
        }
        return run(engine, {name: (tokens, params[name]) for name, (tokens, _) in prompts.items()})

    stored, dequantized = generate(smol_loaded), generate(float_loaded)
    for key, out in dequantized.items():
        assert stored[key]["tokens"] == out["tokens"], key


def test_quantization_none_keeps_float_weights(float_loaded: LoadedModel) -> None:
    projections = [m for m in float_loaded.model.modules() if isinstance(m, Linear)]
    assert all(m.quantized is None and m.weight.numel() > 0 for m in projections)
    assert float_loaded.model.quantized_head is None


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1"])
def test_quantization_on_load_multiplies_by_what_the_blocks_hold(
    tiny_model_dir: Callable[[str], Path], qtype: str
) -> None:
    """A safetensors model quantized at load: each projection and the LM head equal the float products with
    the weights the blocks hold (dequantize(quantize(w))); the kernels add only float rounding."""
    folder = str(tiny_model_dir("llama"))
    quantized = load_model(EngineConfig(model=folder, quantization=qtype))
    float_model = load_model(EngineConfig(model=folder, quantization="none")).model
    pairs = [
        (twin, module)
        for twin, module in zip(quantized.model.modules(), float_model.modules(), strict=True)
        if isinstance(module, Linear)
    ]
    assert pairs and all(twin.quantized is not None and twin.quantized.qtype == qtype for twin, _ in pairs)
    for twin, module in pairs:
        x = torch.randn(3, module.in_features)
        expected = x @ dequantize(quantize(module.weight.data, qtype)).T
        torch.testing.assert_close(twin(x).contiguous(), expected, rtol=1e-4, atol=1e-4)
    hidden = torch.randn(5, quantized.spec.hidden_size)
    head = float_model.embed_tokens.weight if float_model.lm_head is None else float_model.lm_head.weight
    expected = hidden @ dequantize(quantize(head.data, qtype)).T
    torch.testing.assert_close(quantized.model.compute_logits(hidden), expected, rtol=1e-4, atol=1e-4)


def test_tied_embedding_is_looked_up_in_the_head_blocks(smol_loaded: LoadedModel, float_loaded: LoadedModel) -> None:
    """The embedded model ties its head: lookups read the Q8_0 blocks it multiplies by, and give exactly the
    dequantized embedding, so no float copy of the table is kept."""
    model = smol_loaded.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.embed_tokens.table is model.quantized_head
    ids = torch.tensor([0, 1, 17, 4096, float_loaded.spec.vocab_size - 1, 17])
    assert torch.equal(model.embed_tokens(ids), float_loaded.model.embed_tokens(ids))


def test_a_head_quantized_at_load_leaves_the_embedding_float(tiny_model_dir: Callable[[str], Path]) -> None:
    loaded = load_model(EngineConfig(model=str(tiny_model_dir("qwen2")), quantization="q4_0"))  # tied
    assert loaded.model.quantized_head is not None
    assert isinstance(loaded.model.embed_tokens, torch.nn.Embedding)  # quantizing it would change the model


def test_quantization_gguf_needs_a_gguf_file(tiny_model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="quantization 'gguf' keeps a GGUF file's blocks"):
        load_model(EngineConfig(model=str(tiny_model_dir("llama")), quantization="gguf"))


@pytest.mark.parametrize(
    ("quantization", "device", "dtype", "kept"),
    [
        ("auto", "cpu", torch.float32, True),  # the CPU kernels
        ("auto", "cpu", torch.bfloat16, False),  # they read float32 only
        ("auto", "cuda", torch.bfloat16, False),  # the Triton kernel is opt-in on CUDA
        ("gguf", "cuda", torch.bfloat16, True),
        ("q4_k", "cuda", torch.float16, True),
    ],
)
def test_where_projections_keep_block_formats(quantization: str, device: str, dtype: torch.dtype, kept: bool) -> None:
    from pagedserve.kernels.triton_backend import TritonBackend

    config = EngineConfig(quantization=quantization)
    backend = TritonBackend()  # on the CPU it multiplies the CPU blocks, as every backend does
    formats = _formats_multiplied_here(config, backend, torch.device(device), dtype)
    assert formats == (frozenset(FORMATS) if kept else frozenset())
