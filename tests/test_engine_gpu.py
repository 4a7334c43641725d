"""The engine on CUDA: recorded decode graphs generate what eager steps do."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers

from benchmarks.gpu_throughput import save_placeholder_tokenizer
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
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
