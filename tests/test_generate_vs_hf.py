"""Greedy output of the embedded SmolLM2 is token-for-token transformers' `generate`, however it is batched.

On float32 activations (FLOAT32): 8-bit ones (activation_dtype int8, the CPU's default) no longer compute the
dequantized model transformers runs; benchmarks/teacher_forcing.py measures how far they move its tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.engine import SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.text.tokenizer import apply_chat_template
from pagedserve.engine.worker.model_loader import LoadedModel

QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime.",
    "Translate 'good morning' into Spanish, French and German.",
    "Explain in two sentences what a hash table is, and give one example of where it is used in practice.",
    "You are planning a picnic for ten people in a park near a river. Write a short checklist of what to bring, "
    "including food, drinks, games and anything needed to keep the place clean afterwards.",
    "Summarise the plot of a story in which a lighthouse keeper finds a message in a bottle, follows its clues "
    "along the coast, meets the old sailor who wrote it decades earlier, and learns why it was never answered. "
    "Keep it under a hundred words.",
]
MAX_TOKENS = 24
FLOAT32 = "float32"


@pytest.fixture(scope="module")
def prompts(smol_loaded: LoadedModel) -> list[list[int]]:
    tokenizer = smol_loaded.tokenizer
    texts = [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


@pytest.fixture(scope="module")
def reference(smol_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            generated = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids)),
            )
            outputs.append(generated[0, len(ids) :].tolist())
    return outputs


def run_engine(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    return [tokens[str(i)] for i in range(len(prompts))]


def test_prompt_lengths_differ(prompts: list[list[int]]) -> None:
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] < 40 and lengths[-1] > 80


def test_batched_greedy_matches_transformers(smol_loaded, prompts, reference) -> None:
    engine = LLMEngine(EngineConfig(model=str(smol_loaded.model_dir), activation_dtype=FLOAT32), loaded=smol_loaded)
    assert run_engine(engine, prompts) == reference


def test_chunked_prefill_matches_transformers(smol_loaded, prompts, reference) -> None:
    config = EngineConfig(model=str(smol_loaded.model_dir), max_num_batched_tokens=16, activation_dtype=FLOAT32)
    engine = LLMEngine(config, loaded=smol_loaded)
    assert run_engine(engine, prompts) == reference
    assert engine.stats.num_steps > sum(len(p) for p in prompts) // 16  # prompts really were split


def test_preemption_matches_transformers(smol_loaded, prompts, reference) -> None:
    # 20 blocks of 16 tokens hold about two requests at a time: the rest must be preempted and recomputed.
    config = EngineConfig(
        model=str(smol_loaded.model_dir), num_kv_blocks=20, enable_prefix_caching=False, activation_dtype=FLOAT32
    )
    engine = LLMEngine(config, loaded=smol_loaded)
    assert run_engine(engine, prompts) == reference
    assert engine.scheduler.num_preemptions > 0


def test_preemption_with_prefix_cache_matches_transformers(smol_loaded, prompts, reference) -> None:
    config = EngineConfig(
        model=str(smol_loaded.model_dir), num_kv_blocks=20, max_num_batched_tokens=64, activation_dtype=FLOAT32
    )
    engine = LLMEngine(config, loaded=smol_loaded)
    assert run_engine(engine, prompts) == reference
    assert engine.scheduler.num_preemptions > 0
