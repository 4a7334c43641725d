"""Speculative decoding with n-gram proposals: the proposer, and output identical to plain decoding (greedy
token for token; sampling in distribution), with chunked prefill, preemption and prefix caching in the mix."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.engine import SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.speculative.ngram import NgramProposer, propose_ngram
from pagedserve.engine.worker.model_loader import LoadedModel, load_model
from tests.conftest import TINY_COMMON

# Speculating whatever the batch (the budget's default turns it off past two sequences with block formats on the
# CPU): these tests check what speculation outputs, not what it costs.
SPECULATIVE = dict(
    speculative_method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3, speculative_token_budget=2048
)
DRAFT = dict(speculative_method="draft", num_speculative_tokens=3)


def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix() -> None:
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 4, 6, 7]
    assert propose_ngram(tokens, 1, 3, 2) == [2, 3]  # "6 7" last matched at 6..7, then 2 3
    assert propose_ngram(tokens + [8], 1, 3, 3) == [9, 1, 6]  # "6 7 8" beats the later "7 8"? only one match
    assert propose_ngram([1, 2, 3, 4], 1, 3, 2) == []  # no earlier occurrence
    assert propose_ngram([4, 1, 2, 4], 2, 3, 2) == []  # a 1-gram would match, but min is 2
    assert propose_ngram([4, 1, 2, 4], 1, 3, 5) == [1, 2, 4]  # runs to the end
    assert propose_ngram([3, 3, 3, 3], 1, 2, 4) == [3]  # the latest match, right before the suffix
    assert propose_ngram([7], 1, 3, 2) == [] and propose_ngram([1, 2, 1], 1, 3, 0) == []


def test_ngram_proposer_respects_each_sequences_limit() -> None:
    class Seq:
        def __init__(self, request_id: str, tokens: list[int]) -> None:
            self.request_id, self.all_token_ids = request_id, tokens

    proposer = NgramProposer(1, 2, 4)
    sequences = [Seq("a", [1, 2, 3, 4, 5, 1, 2]), Seq("b", [1, 2, 3, 4, 5, 1, 2])]
    assert proposer.propose(sequences, [4, 1]) == [[3, 4, 5, 1], [3]]
    assert proposer.propose(sequences, [0, 9]) == [[], [3, 4, 5, 1]]


def grounded_prompt(rng: random.Random, length: int) -> list[int]:
    """Runs of tokens repeated with variations: places where the output's last tokens recur in the prompt."""
    motifs = [[rng.randrange(100, 4000) for _ in range(rng.randrange(3, 8))] for _ in range(6)]
    out: list[int] = []
    while len(out) < length:
        out += rng.choice(motifs)
    return out[:length]


def generate(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    after_step: Callable[[LLMEngine], None] | None = None,
) -> dict[str, dict]:
    for index, (tokens, param) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{index}", tokens, param)
    results: dict[str, dict] = {}
    while engine.has_unfinished_requests():
        deltas = engine.step()
        if after_step is not None:
            after_step(engine)
        for delta in deltas:
            key = delta.request_id if delta.index == 0 else f"{delta.request_id}/{delta.index}"
            entry = results.setdefault(key, {"tokens": [], "text": "", "logprobs": []})
            entry["tokens"] += delta.new_token_ids
            entry["logprobs"] += [chosen.logprob for chosen in delta.new_logprobs or []]
            entry["text"] += delta.new_text
            if delta.finished:
                entry["finish"], entry["stop_reason"] = delta.finish_reason, delta.stop_reason
                entry["num_output_tokens"] = delta.num_output_tokens
    return results


def make_engine(loaded: LoadedModel, **config: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(loaded.model_dir), **config), loaded=loaded)  # type: ignore[arg-type]


def holds_no_block_past_its_tokens(engine: LLMEngine) -> None:
    """After a step, the blocks of rejected proposals are back in the pool."""
    for request in engine.scheduler.running:
        assert len(engine.kv.req_blocks[request.request_id]) <= engine.kv.blocks_needed(request.num_tokens)


def assert_kv_all_free(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    assert not engine.kv.req_blocks


def test_greedy_tokens_equal_plain_decoding_and_proposals_are_accepted(tiny_llama_loaded: LoadedModel) -> None:
    rng = random.Random(0)
    prompts = [grounded_prompt(rng, 40 + 7 * i) for i in range(4)]
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * len(prompts)
    plain = generate(make_engine(tiny_llama_loaded, num_kv_blocks=64), prompts, params)
    # Blocks of 4 tokens: rejected proposals often reach into a block of their own.
    engine = make_engine(tiny_llama_loaded, num_kv_blocks=256, block_size=4, **SPECULATIVE)
    assert generate(engine, prompts, params, holds_no_block_past_its_tokens) == plain
    stats = engine.collect_stats().speculation
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert_kv_all_free(engine)


def test_greedy_equality_with_chunked_prefill_preemption_and_prefix_caching(tiny_llama_loaded: LoadedModel) -> None:
    rng = random.Random(1)
    shared = grounded_prompt(rng, 48)  # three full blocks every prompt shares: prefix-cache hits
    prompts = [shared + grounded_prompt(rng, 20 + 9 * i) for i in range(8)]
    params = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)] * len(prompts)
    plain = generate(make_engine(tiny_llama_loaded, num_kv_blocks=256), prompts, params)
    # 40 blocks of 16 cannot hold 8 sequences of ~130 tokens: the newest are preempted; a budget of 64 tokens
    # splits the prompts into chunks.
    engine = make_engine(tiny_llama_loaded, num_kv_blocks=40, max_num_batched_tokens=64, **SPECULATIVE)
    assert generate(engine, prompts, params) == plain
    assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0
    assert engine.collect_stats().speculation.num_accepted_tokens > 0
    assert_kv_all_free(engine)
    assert all(b.block_hash is None or b.token_ids for b in engine.kv.pool.blocks)


def test_cached_blocks_hold_only_verified_tokens(tiny_llama_loaded: LoadedModel) -> None:
    """Every block the prefix cache can hand out holds tokens of some sequence's final output or prompt."""
    rng = random.Random(2)
    prompts = [grounded_prompt(rng, 50) for _ in range(3)]
    params = [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)] * len(prompts)
    engine = make_engine(tiny_llama_loaded, num_kv_blocks=64, **SPECULATIVE)
    results = generate(engine, prompts, params)
    sequences = [p + results[f"r{i}"]["tokens"] for i, p in enumerate(prompts)]
    size = engine.kv.block_size
    known = {tuple(s[j : j + size]) for s in sequences for j in range(0, len(s) - size + 1, size)}
    cached = [b.token_ids for b in engine.kv.pool.cached.values()]
    assert cached and all(tokens in known for tokens in cached)


SENTENCE = "The old lighthouse keeper painted seven blue boats before the autumn storms reached the harbour."


def test_stop_strings_end_a_sequence_inside_an_accepted_run(smol_loaded: LoadedModel) -> None:
    """The embedded model copies a sentence from its prompt (proposals accepted in runs); a stop string on
    each of its words ends the output at the same token, with the same text and finish, as plain decoding."""
    messages = [{"role": "user", "content": f"Repeat this sentence exactly, nothing else: {SENTENCE}"}]
    text = smol_loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = smol_loaded.tokenizer.encode(text, add_special_tokens=False)
    stops = [f" {word}" for word in SENTENCE.split()[1:]]
    params = [SamplingParams(max_tokens=30, temperature=0, stop=[stop]) for stop in stops]
    plain = generate(make_engine(smol_loaded, num_kv_blocks=256), [prompt] * len(stops), params)
    engine = make_engine(smol_loaded, num_kv_blocks=256, **SPECULATIVE)
    assert generate(engine, [prompt] * len(stops), params) == plain
    assert sum(r["finish"] == "stop" for r in plain.values()) > len(stops) // 2
    assert engine.collect_stats().speculation.num_accepted_tokens > 10
    assert_kv_all_free(engine)


def test_penalties_bias_and_min_tokens_apply_at_every_verified_position(tiny_vocab_loaded: LoadedModel) -> None:
    """Greedy on a model whose logits differ enough that penalties change its choices: each proposed position
    is judged with the accepted tokens before it counted."""
    prompts = [[0, 1, 2, 3, 4, 5, 6] * 3, [5, 6, 5, 4, 3, 5, 6, 5, 4] * 2, [1, 2, 1, 2, 3, 1, 2, 1, 2, 3] * 2]
    variants = [
        dict(frequency_penalty=0.2),
        dict(frequency_penalty=0.6, presence_penalty=0.3),
        dict(repetition_penalty=1.3),
        dict(presence_penalty=1.0),
        dict(logit_bias={3: 1.5, 5: -0.5}),
        dict(min_tokens=12),
        dict(min_tokens=5, frequency_penalty=0.1, stop_token_ids=[4]),
    ]
    params = [
        SamplingParams(max_tokens=24, temperature=0, detokenize=False, **variant)  # type: ignore[arg-type]
        for variant in variants
        for _ in prompts
    ]
    all_prompts = prompts * len(variants)
    plain = generate(make_engine(tiny_vocab_loaded, num_kv_blocks=128), all_prompts, params)
    engine = make_engine(tiny_vocab_loaded, num_kv_blocks=128, **SPECULATIVE)
    assert generate(engine, all_prompts, params) == plain
    assert engine.collect_stats().speculation.num_accepted_tokens > 50
    assert_kv_all_free(engine)


def record_longest_proposals(engine: LLMEngine) -> list[tuple[int, int]]:
    """(running sequences, the most tokens one of them proposed) of every step the engine schedules from now."""
    steps: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule(proposals: dict[str, list[int]] | None = None):  # type: ignore[no-untyped-def]
        out = schedule(proposals)
        steps.append((len(engine.scheduler.running), max(len(s.draft_token_ids) for s in out.scheduled)))
        return out

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    return steps


def test_speculation_off_per_request_and_when_the_batch_is_large(tiny_llama_loaded: LoadedModel) -> None:
    rng = random.Random(4)
    prompts = [grounded_prompt(rng, 40) for _ in range(4)]
    off = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, speculative=False)
    engine = make_engine(tiny_llama_loaded, num_kv_blocks=64, **SPECULATIVE)
    generate(engine, prompts, [off] * 4)
    assert engine.collect_stats().speculation.num_drafts == 0
    # A budget of 11 tokens: k 3 for 1-2 running, 2 for 3, 1 for 4 (running x (k + 1) <= 11); of 7: none for 4.
    on = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for budget, most_at_four in ((11, 1), (7, 0)):
        engine = make_engine(tiny_llama_loaded, num_kv_blocks=64, **{**SPECULATIVE, "speculative_token_budget": budget})
        steps = record_longest_proposals(engine)
        generate(engine, prompts, [on] * 4)
        assert all(longest <= min(3, budget // running - 1) for running, longest in steps)
        assert max(longest for running, longest in steps if running == 4) == most_at_four
    engine = make_engine(tiny_llama_loaded, num_kv_blocks=64, speculative_default=False, **SPECULATIVE)
    generate(engine, prompts, [on, on, on, SamplingParams(max_tokens=20, temperature=0, speculative=True)])
    assert engine.collect_stats().speculation.num_drafts > 0


def chi_square_p_value(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> float:
    """Two-sample chi-square test of homogeneity over the outcomes seen (the rare ones pooled)."""
    outcomes = sorted(set(a) | set(b))
    counts = torch.tensor([[a.count(o), b.count(o)] for o in outcomes], dtype=torch.float64)
    rare = counts.sum(1) < 10
    counts = torch.cat([counts[~rare], counts[rare].sum(0, keepdim=True)])
    counts = counts[counts.sum(1) > 0]
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(counts) - 1))
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


@pytest.fixture(scope="module")
def tiny_vocab_loaded(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> LoadedModel:
    """A random Llama over 8 tokens, its weights large enough that each position's distribution differs."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **{**TINY_COMMON, "vocab_size": 8, "eos_token_id": 7, "max_position_embeddings": 256},
        initializer_range=0.3,
    )
    folder = tmp_path_factory.mktemp("tiny-vocab")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(smol_dir).save_pretrained(folder)
    return load_model(EngineConfig(model=str(folder)))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampling_distribution_is_unchanged_by_speculation(tiny_vocab_loaded: LoadedModel, method: str) -> None:
    """Temperature 1, top-p 0.9: the joint distribution of the first four tokens, over many seeded requests,
    is the same with and without speculation (a two-sample chi-square test), and so is each position's; with
    n-gram proposals and with a draft model's (greedy: a point mass, as the verification assumes)."""
    prompt = [0, 1, 2, 3, 4, 5, 6] * 3  # every token recurs: every decoding step has a proposal
    num_requests = 3000
    params = [
        SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True, detokenize=False)
        for i in range(num_requests)
    ]
    config = dict(num_kv_blocks=1024, max_num_seqs=256, max_num_batched_tokens=2048, max_queue_len=4096)
    plain = generate(make_engine(tiny_vocab_loaded, **config), [prompt] * num_requests, params)
    # The target as its own draft proposes its most likely tokens: accepted with their probability, at top-p 0.9
    # often rejected too.
    proposer = SPECULATIVE if method == "ngram" else DRAFT | {"draft_model": str(tiny_vocab_loaded.model_dir)}
    engine = make_engine(tiny_vocab_loaded, **config, **proposer)
    speculative = generate(engine, [prompt] * num_requests, params)
    stats = engine.collect_stats().speculation
    assert stats.num_accepted_tokens > num_requests and stats.num_draft_tokens > stats.num_accepted_tokens
    a = [tuple(plain[f"r{i}"]["tokens"]) for i in range(num_requests)]
    b = [tuple(speculative[f"r{i}"]["tokens"]) for i in range(num_requests)]
    assert len(set(a)) > 20
    assert chi_square_p_value(a, b) > 1e-3
    for position in range(4):
        assert chi_square_p_value([t[position:][:1] for t in a], [t[position:][:1] for t in b]) > 1e-3
    assert_kv_all_free(engine)


@pytest.mark.parametrize("seed", [7])
def test_seeded_sampling_repeats_itself_with_speculation(tiny_llama_loaded: LoadedModel, seed: int) -> None:
    rng = random.Random(5)
    prompts = [grounded_prompt(rng, 40) for _ in range(2)]
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=seed, ignore_eos=True)] * 2
    first = generate(make_engine(tiny_llama_loaded, num_kv_blocks=64, **SPECULATIVE), prompts, params)
    second = generate(make_engine(tiny_llama_loaded, num_kv_blocks=64, **SPECULATIVE), prompts, params)
    assert first == second


def test_offline_api_takes_the_speculative_config(tiny_llama_loaded: LoadedModel) -> None:
    from pagedserve.engine import LLM

    rng = random.Random(6)
    prompts = [grounded_prompt(rng, 50) for _ in range(3)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    config = EngineConfig(model=str(tiny_llama_loaded.model_dir), num_kv_blocks=64)
    with LLM.from_config(config, loaded=tiny_llama_loaded) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM.from_config(config.replace(**SPECULATIVE), loaded=tiny_llama_loaded) as llm:
        speculative = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats().speculation
    assert speculative == plain and stats.num_accepted_tokens > 0


def test_the_request_field_reaches_the_sampling_params() -> None:
    from pagedserve.server.completions.protocol import CompletionRequest

    assert CompletionRequest(model="m", prompt="Hi", speculative=False).sampling_params().speculative is False
    assert CompletionRequest(model="m", prompt="Hi").sampling_params().speculative is None


def test_the_responses_api_takes_the_request_field_too() -> None:
    from pagedserve.server.responses.protocol import ResponsesRequest

    for given in (False, True, None):
        body = {"model": "m", "input": "Hi"} | ({} if given is None else {"speculative": given})
        request = ResponsesRequest.model_validate(body)
        assert request.sampling_params(request.tool_plan("hermes")).speculative is given


def test_metrics_export_the_counters_as_vllm_names_them() -> None:
    from pagedserve.engine.core.messages import EngineSnapshot
    from pagedserve.server.metrics import ServerMetrics

    class Engine:
        def snapshot(self) -> EngineSnapshot:
            return EngineSnapshot(
                spec_decode_num_drafts=3,
                spec_decode_num_draft_tokens=9,
                spec_decode_num_accepted_tokens=5,
                spec_decode_num_accepted_tokens_per_pos=(3, 2, 0),
            )

        def queue_places_held(self) -> int:
            return 0

    text = ServerMetrics(Engine(), "m").render().decode()  # type: ignore[arg-type]
    assert 'pagedserve:spec_decode_num_draft_tokens_total{model_name="m"} 9.0' in text
    assert 'pagedserve:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in text
    assert 'pagedserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0' in text


def test_a_sequence_whose_proposals_are_rejected_outright_proposes_less_often() -> None:
    from pagedserve.engine.core.speculator import _note_outcome, _pausing
    from pagedserve.engine.scheduling.request import Request

    request = Request("r", [1, 2, 3], SamplingParams(), max_tokens=10)
    pauses = []
    for _ in range(4):
        _note_outcome(request, accepted=0, proposed=4)
        steps = 0
        while _pausing(request):
            steps += 1
        pauses.append(steps)
    assert pauses == [1, 2, 4, 4]
    _note_outcome(request, accepted=2, proposed=4)
    assert not _pausing(request) and request.speculation_misses == 0


def test_a_sequence_proposes_as_many_tokens_as_its_acceptance_makes_worth_verifying() -> None:
    from pagedserve.engine.core.speculator import _note_outcome, proposal_limit
    from pagedserve.engine.scheduling.request import Request

    request = Request("r", [1, 2, 3], SamplingParams(), max_tokens=10)
    assert proposal_limit(request, 4) == 4  # new: the prior trusts the proposer
    for _ in range(3):
        _note_outcome(request, accepted=1, proposed=4)  # one of four: about half accepted
    assert proposal_limit(request, 4) == 1
    for _ in range(4):
        _note_outcome(request, accepted=4, proposed=4)
    assert proposal_limit(request, 4) == 4
    for _ in range(6):
        _note_outcome(request, accepted=0, proposed=1)
    assert proposal_limit(request, 4) == 1  # never none: the pauses throttle it, and proposing is how it learns


def test_proposals_after_a_kept_one_are_valued_by_how_often_runs_continue() -> None:
    from pagedserve.engine.core.speculator import _note_outcome, proposal_chances
    from pagedserve.engine.scheduling.request import Request

    request = Request("r", [1, 2, 3], SamplingParams(), max_tokens=10)
    assert proposal_chances(request, 3) == pytest.approx([0.9, 0.81, 0.729])  # the prior
    assert proposal_chances(request, 0) == []
    for _ in range(6):  # copied runs: the first proposal kept half the time, then every one of the run
        _note_outcome(request, accepted=4, proposed=4)
        _note_outcome(request, accepted=0, proposed=4)
    first, second, third = proposal_chances(request, 3)
    assert 0.5 < first < 0.65  # half, and the prior's 0.9
    assert second / first > 0.95 and third / second > 0.95
    for _ in range(6):  # a run rarely continues past its first token
        _note_outcome(request, accepted=1, proposed=4)
    first, second = proposal_chances(request, 2)
    assert first > 0.9 and second / first < 0.45


def test_parallel_samples_and_prompt_logprobs_speculate_beside_each_other(tiny_vocab_loaded: LoadedModel) -> None:
    """n = 3 samples fork from one prompt's blocks (copied on write) and then verify proposals each; a request
    that scores its prompt speculates after it; greedy ones equal plain decoding, and every block comes back."""
    prompts = [[0, 1, 2, 3, 4, 5, 6] * 3, [5, 6, 5, 4, 3, 5, 6, 5, 4] * 2]
    params = [
        SamplingParams(n=3, max_tokens=40, temperature=0, ignore_eos=True, detokenize=False),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, detokenize=False, prompt_logprobs=2),
    ]
    plain = generate(make_engine(tiny_vocab_loaded, num_kv_blocks=128), prompts, params)
    engine = make_engine(tiny_vocab_loaded, num_kv_blocks=128, block_size=4, **SPECULATIVE)
    speculative = generate(engine, prompts, params, holds_no_block_past_its_tokens)
    assert speculative == plain and len(plain["r0/2"]["tokens"]) == 40
    assert engine.collect_stats().speculation.num_accepted_tokens > 0
    assert_kv_all_free(engine)
