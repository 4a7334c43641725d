"""The engine on CUDA: recorded decode graphs generate what eager steps do; projections kept in block formats
(the Triton dequant-GEMM) generate what the dequantized float model does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers

from benchmarks.gpu_throughput import save_placeholder_tokenizer
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
from pagedserve.engine.worker.models.layers import Linear
from pagedserve.kernels.device_blocks import DeviceQuantizedWeight
from pagedserve.kernels.quantized_reference import dequantize, quantize
from tests.test_engine import run

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs compiled Triton kernels (TRITON_INTERPRET=1 is set)", allow_module_level=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama with the 8B model's head shape (head_dim 128, 4 query heads per KV head)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=4096,
    )
    folder = tmp_path_factory.mktemp("gpu-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    save_placeholder_tokenizer(folder)
    return folder


def test_decode_graphs_generate_what_eager_steps_do(model_dir: Path) -> None:
    """Five sequences leave one by one, so steps replay graphs of sizes 8, 4, 2 and 1 with padding rows."""
    generator = torch.Generator().manual_seed(1)
    lengths = (700, 33, 1500, 16, 260)
    prompts = [torch.randint(3, 4096, (n,), generator=generator).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 40, 25, 60, 5)]
    # float32, so that padded batches (other GEMM shapes) cannot flip a greedy choice by rounding alone.
    config = dict(model=str(model_dir), dtype="float32", num_kv_blocks=1024, max_num_seqs=8, max_model_len=4096)
    eager = LLMEngine(EngineConfig(**config, enforce_eager=True))
    graphed = LLMEngine(EngineConfig(**config))
    graphs = graphed.runner.decode_graphs
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 8]
    assert eager.runner.decode_graphs is None
    requests = {str(i): (prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))}
    assert run(graphed, requests) == run(eager, requests)
    assert graphs.num_replays >= 40
    assert graphed.kv.pool.num_free == 1024


def _greedy_requests(lengths: tuple[int, ...], max_tokens: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Prompts of random tokens (decode steps of one and of several sequences, a prefill of several tiles)."""
    generator = torch.Generator().manual_seed(2)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return {str(i): (torch.randint(3, 4096, (n,), generator=generator).tolist(), params) for i, n in enumerate(lengths)}


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k"])  # every format runs at 8B shapes in test_kernels_triton_quantized
def test_projections_quantized_on_load_generate_what_the_dequantized_model_does(model_dir: Path, qtype: str) -> None:
    """Every projection and the LM head multiply by their repacked blocks (decode graphs included); the float twin
    holds dequantize(quantize(w)). float32, so that only accumulation order differs between the two."""
    config = dict(model=str(model_dir), dtype="float32", num_kv_blocks=256, max_num_seqs=8, max_model_len=4096)
    quantized = LLMEngine(EngineConfig(**config, quantization=qtype))
    projections = [m for m in quantized.runner.model.modules() if isinstance(m, Linear)]
    assert projections and all(isinstance(m.quantized, DeviceQuantizedWeight) for m in projections)
    dequantized = LLMEngine(EngineConfig(**config, quantization="none"))
    with torch.no_grad():
        for module in dequantized.runner.model.modules():
            if isinstance(module, Linear):  # in place: recorded graphs keep reading the same tensors
                module.weight.copy_(dequantize(quantize(module.weight, qtype)))
    requests = _greedy_requests((5, 37, 300), max_tokens=20)
    expected = run(dequantized, requests)
    assert all(len(set(out["tokens"])) > 3 for out in expected.values()), "a model repeating one token tests little"
    assert run(quantized, requests) == expected


def test_gguf_blocks_on_the_gpu_generate_what_the_dequantized_model_does(smol_dir: Path) -> None:
    """The embedded SmolLM2 (Q4_1 projections, a tied Q8_0 head) with `quantization: gguf`: its float twin is
    the same file dequantized, so in float32 the two differ only in accumulation order."""
    config = dict(model=str(smol_dir), dtype="float32", num_kv_blocks=256, max_model_len=2048)
    stored = LLMEngine(EngineConfig(**config, quantization="gguf"))
    model = stored.runner.model
    assert isinstance(model.quantized_head, DeviceQuantizedWeight)
    assert isinstance(model.embed_tokens, torch.nn.Embedding)  # lookups read CPU blocks: the embedding stays float
    dequantized = LLMEngine(EngineConfig(**config, quantization="none"))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "Count to twenty: one, two, three, " * 12]
    requests = {str(i): (prompt, params) for i, prompt in enumerate(prompts)}
    assert run(stored, requests) == run(dequantized, requests)
