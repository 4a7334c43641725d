"""Shared fixtures: the embedded SmolLM2 (converted once) and tiny random models saved locally."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the engine's default (engine/__init__.py); torch loads first here

import torch

# Triton chooses between compiling and interpreting when first imported: without CUDA, interpret (on CPU
# tensors). Set here, before any test module imports it.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import transformers

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.model_loader import LoadedModel, load_model
from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path
from pagedserve.engine.worker.weights.gguf_files import dequantized_model_dir

TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    vocab_size=49152,  # the SmolLM2 tokenizer's, so tiny models can share it
    eos_token_id=2,
    bos_token_id=1,
)

TINY_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama": lambda: transformers.LlamaConfig(**TINY_COMMON, tie_word_embeddings=False),
    "llama3-rope": lambda: transformers.LlamaConfig(
        **TINY_COMMON,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ),
    # head_dim 64: the smallest the Triton backend supports
    "llama-hd64": lambda: transformers.LlamaConfig(**{**TINY_COMMON, "hidden_size": 256}),
    "mistral": lambda: transformers.MistralConfig(**TINY_COMMON, sliding_window=None),
    # Mistral v0.1's window, shrunk: every layer reads only its last 8 tokens
    "mistral-window": lambda: transformers.MistralConfig(**TINY_COMMON, sliding_window=8),
    "qwen2": lambda: transformers.Qwen2Config(**TINY_COMMON, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**TINY_COMMON, head_dim=32),
}


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    return dequantized_model_dir(embedded_gguf_path())


@pytest.fixture(scope="session")
def smol_loaded(smol_dir: Path) -> LoadedModel:
    return load_model(EngineConfig(model=str(smol_dir)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Callable[[str], Path]:
    """Saves a tiny random model of the given family (with the SmolLM2 tokenizer) and returns its folder."""
    made: dict[str, Path] = {}
    tokenizer = transformers.AutoTokenizer.from_pretrained(smol_dir)

    def make(family: str) -> Path:
        if family not in made:
            torch.manual_seed(0)
            config = TINY_CONFIGS[family]()
            model = transformers.AutoModelForCausalLM.from_config(config)
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            made[family] = folder
        return made[family]

    return make


@pytest.fixture(scope="session")
def tiny_llama_loaded(tiny_model_dir: Callable[[str], Path]) -> LoadedModel:
    return load_model(EngineConfig(model=str(tiny_model_dir("llama"))))
