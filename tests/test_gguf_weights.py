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
from pagedserve.engine.worker.weights.checkpoint import iter_safetensors
from pagedserve.engine.worker.weights.gguf_files import INDEX_FILE, gguf_model_dir, gguf_source
from pagedserve.kernels.quantized import FORMATS, QuantizedWeight, dequantize, quantize
from tests.test_engine import run


@pytest.fixture(scope="module")
def float_loaded(smol_dir: Path) -> LoadedModel:
    return load_model(EngineConfig(model=str(smol_dir), quantization="none"))


def test_stored_blocks_are_the_dequantized_weights(smol_loaded: LoadedModel, float_loaded: LoadedModel) -> None:
    """Every projection read from the file as blocks holds, bit for bit, the weight transformers dequantizes
    (fused, and un-permuted where llama.cpp permuted q and k), and the float path reads the same values."""
    assert gguf_source(smol_loaded.model_dir) is not None
    floats = dict(float_loaded.model.named_modules())
    reference = dict(iter_safetensors(smol_loaded.model_dir))  # transformers' own dequantization
    projections = {n: m for n, m in smol_loaded.model.named_modules() if isinstance(m, Linear)}
    assert len(projections) == 4 * smol_loaded.spec.num_layers
    for name, module in projections.items():
        assert isinstance(module.quantized, QuantizedWeight), name
        float_twin = floats[name]
        assert isinstance(float_twin, Linear) and float_twin.quantized is None
        assert torch.equal(dequantize(module.quantized), float_twin.weight.data), name
    for part in ("q_proj", "k_proj", "v_proj"):
        rows = reference[f"model.layers.3.self_attn.{part}.weight"]
        start = {"q_proj": 0, "k_proj": 576, "v_proj": 768}[part]
        assert torch.equal(floats["layers.3.self_attn.qkv_proj"].weight.data[start : start + len(rows)], rows), part
    assert torch.equal(float_loaded.model.embed_tokens.weight.data, reference["model.embed_tokens.weight"])


def test_the_model_folder_holds_no_weights(smol_loaded: LoadedModel) -> None:
    """A GGUF file is served from the file: its folder is its config, tokenizer and tensor index (a few MB)."""
    folder = gguf_model_dir(gguf_source(smol_loaded.model_dir))  # type: ignore[arg-type]
    assert not list(folder.glob("*.safetensors")) and (folder / INDEX_FILE).exists()
    assert sum(f.stat().st_size for f in folder.iterdir()) < 8 * 2**20


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
