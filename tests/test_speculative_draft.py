"""Draft-model speculation: greedy output identical to plain decoding whatever the draft (itself, a different
random model), the draft's own KV blocks following the sequences (freed when they finish or are preempted),
sampling unchanged in distribution, and a draft of another vocabulary refused at start-up."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import transformers

from pagedserve.engine import SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.speculative.draft import DraftModelProposer
from pagedserve.engine.speculative.draft_blocks import DraftBlocks, DraftState
from pagedserve.engine.worker.model_loader import LoadedModel
from tests.test_speculative import assert_kv_all_free, generate, grounded_prompt, make_engine


def draft_config(draft: Path, k: int = 3) -> dict[str, object]:
    return dict(speculative_method="draft", draft_model=str(draft), num_speculative_tokens=k)


def draft_blocks(engine: LLMEngine) -> DraftBlocks:
    proposer = engine.speculator.proposer
    assert isinstance(proposer, DraftModelProposer)
    return proposer.blocks


def assert_draft_blocks_follow_the_running(engine: LLMEngine) -> None:
    """After a step the draft holds blocks only for running sequences, none past what a round writes."""
    blocks = draft_blocks(engine)
    running = {r.request_id: r for r in engine.scheduler.running}
    assert set(blocks.states) <= set(running)
    k = engine.speculator.num_tokens
    for request_id, state in blocks.states.items():
        assert len(state.blocks) <= -(-(running[request_id].num_tokens + k) // blocks.block_size)
    held = sum(len(s.blocks) for s in blocks.states.values())
    assert held + len(blocks.free) == blocks.num_blocks and len(set(blocks.free)) == len(blocks.free)


def assert_draft_blocks_all_free(engine: LLMEngine) -> None:
    blocks = draft_blocks(engine)
    assert not blocks.states and sorted(blocks.free) == list(range(blocks.num_blocks))


def test_the_draft_state_keeps_the_accepted_proposals() -> None:
    state = DraftState(num_known=5, proposed=[7, 8])
    assert state.num_valid([1, 2, 3, 4, 5, 7, 8, 9]) == 7  # both accepted, then the target's own token
    assert state.num_valid([1, 2, 3, 4, 5, 7, 6]) == 6  # the second rejected
    assert state.num_valid([1, 2, 3, 4, 5, 7]) == 5  # the last token is always fed again
    assert DraftState().num_valid([1, 2, 3]) == 0


def test_target_as_its_own_draft_accepts_every_proposal(tiny_llama_loaded: LoadedModel) -> None:
    rng = random.Random(10)
    prompts = [grounded_prompt(rng, 30 + 11 * i) for i in range(5)]
    params = [SamplingParams(max_tokens=30 + 3 * i, temperature=0, ignore_eos=True) for i in range(5)]
    plain = generate(make_engine(tiny_llama_loaded, num_kv_blocks=128), prompts, params)
    engine = make_engine(
        tiny_llama_loaded, num_kv_blocks=128, block_size=4, **draft_config(tiny_llama_loaded.model_dir)
    )
    assert generate(engine, prompts, params, assert_draft_blocks_follow_the_running) == plain
    stats = engine.collect_stats().speculation
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert_kv_all_free(engine)
    assert_draft_blocks_all_free(engine)


def test_a_different_draft_model_gives_the_targets_greedy_tokens(
    tiny_llama_loaded: LoadedModel, tiny_model_dir: Callable[[str], Path]
) -> None:
    """A random Qwen3 drafting for a random Llama: mostly rejected, with preemption and chunked prefill in the
    mix (the draft catches up from scratch on a preempted sequence), the output is the Llama's."""
    rng = random.Random(11)
    prompts = [grounded_prompt(rng, 40 + 9 * i) for i in range(8)]
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * len(prompts)
    plain = generate(make_engine(tiny_llama_loaded, num_kv_blocks=256), prompts, params)
    draft = draft_config(tiny_model_dir("qwen3"), k=4)
    engine = make_engine(tiny_llama_loaded, num_kv_blocks=40, max_num_batched_tokens=64, **draft)
    assert generate(engine, prompts, params, assert_draft_blocks_follow_the_running) == plain
    assert engine.scheduler.num_preemptions > 0
    stats = engine.collect_stats().speculation
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert_kv_all_free(engine)
    assert_draft_blocks_all_free(engine)


def test_an_aborted_request_gives_back_its_draft_blocks(tiny_llama_loaded: LoadedModel) -> None:
    rng = random.Random(12)
    engine = make_engine(tiny_llama_loaded, num_kv_blocks=64, **draft_config(tiny_llama_loaded.model_dir))
    for i in range(3):
        engine.add_request(f"r{i}", grounded_prompt(rng, 40), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert len(draft_blocks(engine).states) == 3
    engine.abort_request("r1")
    engine.step()
    assert set(draft_blocks(engine).states) == {"r0", "r2"}
    engine.abort_request("r0")
    engine.abort_request("r2")
    engine.step()
    assert_draft_blocks_all_free(engine)


def test_a_draft_with_another_vocabulary_is_refused(
    tiny_llama_loaded: LoadedModel, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = tmp_path / "other-vocab"
    source = tiny_model_dir("llama")
    transformers.AutoModelForCausalLM.from_pretrained(source).save_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    tokenizer.add_tokens(["<a-token-of-its-own>"])
    tokenizer.save_pretrained(folder)
    with pytest.raises(ValueError, match="does not share the target's tokenizer vocabulary"):
        make_engine(tiny_llama_loaded, num_kv_blocks=64, **draft_config(folder))


def test_the_draft_method_needs_a_draft_model() -> None:
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(speculative_method="draft")
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(speculative_method="ngram", draft_model="x")


def test_offline_api_takes_the_draft_model(tiny_llama_loaded: LoadedModel) -> None:
    from pagedserve.engine import LLM

    prompts = [grounded_prompt(random.Random(13), 30)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    config = EngineConfig(model=str(tiny_llama_loaded.model_dir), num_kv_blocks=64)
    with LLM.from_config(config, loaded=tiny_llama_loaded) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    draft = config.replace(**draft_config(tiny_llama_loaded.model_dir))
    with LLM.from_config(draft, loaded=tiny_llama_loaded) as llm:
        speculative = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats().speculation
    assert speculative == plain and stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_the_quantized_gguf_as_its_own_draft_accepts_every_proposal() -> None:
    """The embedded GGUF in its blocks with the default activations (16-bit on the CPU): the target verifies with
    the activations its one-token steps take (its proposed rows aside), and so does the draft, which then proposes
    exactly what the verification computes. (8-bit ones reached 75 of 76 on a Xeon: the draft's one-row steps and
    the target's verifying step rounded a near-tie apart.)"""
    from pagedserve.engine import LLM
    from pagedserve.engine.worker import embedded_gguf_path

    gguf = str(embedded_gguf_path())
    config = EngineConfig(num_kv_blocks=64, **draft_config(Path(gguf), k=4))  # type: ignore[arg-type]
    messages = [[{"role": "user", "content": "Write a short story about a fox who learns to play the violin."}]]
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    with LLM.from_config(config.replace(engine_process=False)) as llm:
        llm.chat(messages, params, use_tqdm=False)
        stats = llm.stats().speculation
    assert stats.num_draft_tokens > 20 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_serve_takes_the_draft_flags() -> None:
    from pagedserve.server import cli
    from pagedserve.server.engine_args import engine_config

    argv = ["serve", "--speculative-method", "draft", "--draft-model", "/models/small", "--num-speculative-tokens", "5"]
    config = engine_config(cli.build_parser().parse_args(argv))
    assert (config.speculative_method, config.draft_model, config.num_speculative_tokens) == (
        "draft",
        "/models/small",
        5,
    )
