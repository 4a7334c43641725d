"""The transformers fallback: architectures without a native implementation, run by transformers' own modules
with paged attention, give transformers' greedy tokens (float32) through the offline API and the server, with
chunked prefill, prefix-cache hits and preemption in the mix; `model_impl` picks and refuses clearly."""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.sampling_params import StructuredOutput
from pagedserve.engine.worker.model_loader import LoadedModel, load_model
from pagedserve.engine.worker.models.transformers_fallback import TransformersForCausalLM
from pagedserve.server import ServerSettings
from pagedserve.server.engine_args import add_engine_args, engine_config
from tests.servers import served_engine

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    vocab_size=49152,  # the SmolLM2 tokenizer's
    eos_token_id=2,
    bos_token_id=1,
)
FALLBACK_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "olmo": lambda: transformers.OlmoConfig(**SMALL, num_key_value_heads=2),
    # Granite scales embeddings, residuals, attention and logits: each must come through as transformers has it.
    "granite": lambda: transformers.GraniteConfig(
        **SMALL,
        num_key_value_heads=2,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=4.0,
    ),
    "stablelm": lambda: transformers.StableLmConfig(**SMALL, num_key_value_heads=2, partial_rotary_factor=0.5),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**SMALL, rotary_pct=0.5, tie_word_embeddings=False),
    "phi": lambda: transformers.PhiConfig(**SMALL, num_key_value_heads=2),
    "gptj": lambda: transformers.GPTJConfig(
        n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=512, vocab_size=49152, eos_token_id=2, bos_token_id=1
    ),
    "olmo2": lambda: transformers.Olmo2Config(**SMALL, num_key_value_heads=2, initializer_range=0.1),
    "falcon": lambda: transformers.FalconConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=49152, new_decoder_architecture=True
    ),
    "mistral-window": lambda: transformers.MistralConfig(
        **SMALL, num_key_value_heads=2, sliding_window=48, initializer_range=0.2
    ),
    "gemma2-softcap": lambda: transformers.Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=16),
    "llama": lambda: transformers.LlamaConfig(
        **SMALL, num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.2
    ),
}
SERVED = ["olmo", "granite", "stablelm", "gpt_neox"]
OFFLINE = [*SERVED, "phi", "gptj", "olmo2"]
MAX_TOKENS = 16
SHARED = list(range(1000, 1040))  # 40 tokens: two full blocks that later requests find cached
# Few blocks and a small token budget: prompts prefill in chunks, and the newest requests are preempted.
MIXED = dict(num_kv_blocks=12, max_num_batched_tokens=24, engine_process=False, activation_dtype="float32")


def prompts() -> list[list[int]]:
    tails = [list(range(200 + 37 * i, 200 + 37 * i + 3 + 5 * i)) for i in range(6)]
    return [SHARED + tail if i % 2 == 0 else tail + SHARED[:10] for i, tail in enumerate(tails)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Callable[[str], Path]:
    """A tiny random model of the family, saved with the SmolLM2 tokenizer (made once per module)."""
    made: dict[str, Path] = {}
    tokenizer = transformers.AutoTokenizer.from_pretrained(smol_dir)

    def make(family: str) -> Path:
        if family not in made:
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(FALLBACK_CONFIGS[family](), dtype=torch.float32)
            folder = tmp_path_factory.mktemp(f"fallback-{family}")
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            made[family] = folder
        return made[family]

    return make


def transformers_greedy(folder: Path, prompt_list: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompt_list:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
            outputs.append(out[0, len(ids) :].tolist())
    assert all(len(set(tokens)) > 3 for tokens in outputs), "a model that repeats one token would test little"
    return outputs


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run_engine(engine: LLMEngine, prompt_list: list[list[int]]) -> list[list[int]]:
    for i, ids in enumerate(prompt_list):
        engine.add_request(str(i), ids, greedy())
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompt_list))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    return [tokens[str(i)] for i in range(len(prompt_list))]


def load(folder: Path, **config: object) -> tuple[EngineConfig, LoadedModel]:
    engine_config = EngineConfig(model=str(folder), **{**MIXED, **config})  # type: ignore[arg-type]
    return engine_config, load_model(engine_config)


@pytest.mark.parametrize("family", OFFLINE)
def test_fallback_matches_transformers_offline(family: str, model_dir: Callable[[str], Path]) -> None:
    folder = model_dir(family)
    config, loaded = load(folder)
    assert isinstance(loaded.model, TransformersForCausalLM)
    expected = transformers_greedy(folder, prompts())
    engine = LLMEngine(config, loaded=loaded)
    assert run_engine(engine, prompts()) == expected
    assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0
    assert engine.stats.num_steps > sum(map(len, prompts())) // 24  # prompts were prefilled in chunks
    with LLM.from_config(config, loaded) as llm:  # the offline API, on the same loaded model
        got = [out.outputs[0].token_ids for out in llm.generate(prompts(), greedy(), use_tqdm=False)]
    assert got == expected


def test_logits_pass_through_the_models_own_head(model_dir: Callable[[str], Path]) -> None:
    """Granite divides its logits by logits_scaling after the LM head: logprobs show it (greedy tokens cannot)."""
    folder = model_dir("granite")
    config, loaded = load(folder)
    prompt = prompts()[0]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, -1], dim=-1)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1)
    with LLM.from_config(config, loaded) as llm:
        (output,) = llm.generate([prompt], params, use_tqdm=False)
    sample = output.outputs[0]
    token = sample.token_ids[0]
    assert token == int(expected.argmax())
    assert sample.logprobs[0].logprob == pytest.approx(float(expected[token]), abs=1e-4)


@pytest.mark.parametrize("family", SERVED)
def test_fallback_matches_transformers_through_the_server(family: str, model_dir: Callable[[str], Path]) -> None:
    folder = model_dir(family)
    config, loaded = load(folder, num_kv_blocks=8)
    prompt_list = prompts()
    expected = transformers_greedy(folder, prompt_list)
    with served_engine(config, loaded, ServerSettings([family])) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        def complete(ids: list[int]) -> str:
            response = client.completions.create(
                model=family, prompt=ids, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            assert response.usage is not None and response.usage.completion_tokens == MAX_TOKENS
            return response.choices[0].text

        with ThreadPoolExecutor(len(prompt_list)) as pool:  # at once: they share the cache, and some are preempted
            got = list(pool.map(complete, prompt_list))
        metrics = httpx.get(f"{url}/metrics").text
    assert got == [loaded.tokenizer.decode(tokens, skip_special_tokens=True) for tokens in expected]
    assert _counter(metrics, "pagedserve:num_preemptions_total") > 0
    assert _counter(metrics, "pagedserve:prefix_cache_hits_total") > 0


def _counter(metrics: str, name: str) -> float:
    lines = [line for line in metrics.splitlines() if line.startswith(name)]
    assert lines, f"{name} is not among the metrics"
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_llama_through_transformers_equals_native(model_dir: Callable[[str], Path]) -> None:
    folder = model_dir("llama")
    config, native = load(folder)
    _, fallback = load(folder, model_impl="transformers")
    assert not isinstance(native.model, TransformersForCausalLM)
    assert isinstance(fallback.model, TransformersForCausalLM)
    assert fallback.spec.num_kv_heads == native.spec.num_kv_heads == 2
    tokens = [run_engine(LLMEngine(config, loaded=loaded), prompts()) for loaded in (native, fallback)]
    assert tokens[0] == tokens[1] == transformers_greedy(folder, prompts())


def test_auto_says_which_implementation_runs(
    model_dir: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        load(model_dir("olmo"))
        load(model_dir("llama"))
    assert "model implementation: transformers fallback for OlmoForCausalLM" in caplog.text
    assert "model implementation: native LlamaForCausalLM" in caplog.text


def test_native_refuses_an_architecture_it_lacks(model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="no native implementation of OlmoForCausalLM"):
        load(model_dir("olmo"), model_impl="native")


def test_a_model_without_the_attention_interface_is_refused(model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="FalconForCausalLM does not take attention implementations by name"):
        load(model_dir("falcon"))


def test_fallback_refuses_block_formats_and_ranks(model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="float weights only"):
        load(model_dir("olmo"), quantization="q8_0")
    with pytest.raises(ValueError, match="runs on one rank"):
        LLMEngine(EngineConfig(model=str(model_dir("olmo")), tensor_parallel_size=2, engine_process=False))


def test_model_impl_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args(["--model-impl", "transformers"])).model_impl == "transformers"
    assert engine_config(parser.parse_args([])).model_impl == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-impl", "hf"])
    with pytest.raises(ValueError, match="model_impl must be one of"):
        EngineConfig(model_impl="hf")


def test_a_gguf_file_through_the_fallback(smol_dir: Path) -> None:
    """The embedded GGUF's weights, dequantized once, in transformers' modules: transformers' tokens."""
    prompt_list = [list(range(100, 108)), list(range(300, 330))]
    config = EngineConfig(model=str(smol_dir), model_impl="transformers", num_kv_blocks=16, engine_process=False)
    loaded = load_model(config)
    assert isinstance(loaded.model, TransformersForCausalLM)
    reference = transformers.AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in prompt_list:
            out = reference.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
            expected.append(out[0, len(ids) :].tolist())
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM.from_config(config, loaded) as llm:
        got = [out.outputs[0].token_ids for out in llm.generate(prompt_list, params, use_tqdm=False)]
    assert got == expected


def test_structured_output_through_the_fallback(model_dir: Callable[[str], Path]) -> None:
    config, loaded = load(model_dir("olmo"))
    constraints = {
        "choice": StructuredOutput.choice(["alpha beta", "gamma"]),
        "regex": StructuredOutput.regex("[a-z]{3}-[0-9]{2}"),
    }
    params = [SamplingParams(temperature=0.0, max_tokens=32, structured_output=c) for c in constraints.values()]
    with LLM.from_config(config, loaded) as llm:
        choice, regex = [out.outputs[0].text for out in llm.generate([prompts()[0]] * 2, params, use_tqdm=False)]
    assert choice in ("alpha beta", "gamma")
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", regex)


def test_a_sliding_window_is_attended_past_the_window(model_dir: Callable[[str], Path]) -> None:
    """Each layer's window reaches the paged kernels with its query: requests run past it (43-68 prompt tokens and
    16 more, a window of 48) with transformers' tokens, chunked, cached and preempted as the others."""
    folder = model_dir("mistral-window")
    config, loaded = load(folder, model_impl="transformers")
    assert loaded.spec.sliding_window == 48
    engine = LLMEngine(config, loaded=loaded)
    assert engine.executor.kv_plan.max_model_len > 48
    assert max(map(len, prompts())) + MAX_TOKENS > 48 + 16
    assert run_engine(engine, prompts()) == transformers_greedy(folder, prompts())


def test_attention_soft_capping_is_refused(model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="uses softcap in attention"):
        load(model_dir("gemma2-softcap"), model_impl="transformers")


def test_serving_a_native_model_never_imports_transformers_modeling() -> None:
    """transformers' modeling modules import torch's compiler, which needs a writable temporary folder that a
    read-only container lacks: only the fallback may load them."""
    check = "import sys, pagedserve.engine.worker.executor; sys.exit('transformers.modeling_utils' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", check], timeout=120).returncode == 0
