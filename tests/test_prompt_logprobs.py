"""Prompt logprobs equal transformers' log-softmax of the same prompt, however the prefill is chunked or cached;
through the server, OpenAI's echo scoring and vLLM's prompt_logprobs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from pagedserve.engine import SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.outputs import TokenLogprob, scored_positions
from pagedserve.engine.scheduling.kv_cache_manager import KVCacheManager
from pagedserve.engine.scheduling.request import Request
from pagedserve.engine.scheduling.scheduler import Scheduler
from pagedserve.engine.worker import model_runner
from pagedserve.engine.worker.batch import PromptRows
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings
from pagedserve.server.completions.protocol import CompletionChoice
from pagedserve.server.logprobs import vllm_prompt_logprobs
from tests.servers import served_engine
from tests.test_engine import run

MODEL = "smol"
TOLERANCE = 1e-4
LogitsFunction = Callable[[torch.Tensor], torch.Tensor]
TEXT = "The quick brown fox jumps over the lazy dog, then naps under a tree by the river bank. " * 3


def hf_prompt_logprobs(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """log p(token i | tokens before it), for i = 1 .. len - 1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(token_ids[1:])[:, None]).squeeze(1)


@pytest.fixture(scope="module")
def prompt(smol_loaded: LoadedModel) -> list[int]:
    return smol_loaded.tokenizer.encode(TEXT)


@pytest.fixture(scope="module")
def reference(smol_dir: Path, prompt: list[int]) -> torch.Tensor:
    return hf_prompt_logprobs(smol_dir, prompt)


def engine_for(loaded: LoadedModel, **config: object) -> LLMEngine:
    """Float32 activations: the scores are transformers' (8-bit ones would not be)."""
    settings = dict(model=str(loaded.model_dir), num_kv_blocks=64, activation_dtype="float32", **config)
    return LLMEngine(EngineConfig(**settings), loaded=loaded)  # type: ignore[arg-type]


def scored(deltas: list, index: int = 0) -> torch.Tensor:
    first = next(d for d in deltas if d.index == index and d.prompt_logprobs is not None)
    assert first.prompt_logprobs[0] is None
    return torch.tensor([item.logprob for item in first.prompt_logprobs[1:]])


def all_deltas(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for request_id, (tokens, params) in requests.items():
        engine.add_request(request_id, tokens, params)
    deltas: dict[str, list] = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
    return deltas


@pytest.mark.parametrize("chunk", [2048, 32, 7])
def test_equal_to_transformers_across_chunked_prefill(
    smol_loaded: LoadedModel, prompt: list[int], reference: torch.Tensor, chunk: int
) -> None:
    engine = engine_for(smol_loaded, max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)
    deltas = all_deltas(engine, {"a": (prompt, params), "b": (prompt[:9], SamplingParams(max_tokens=5))})["a"]
    assert len(deltas[0].prompt_logprobs) == len(prompt)
    assert (scored(deltas) - reference).abs().max() < TOLERANCE
    first = deltas[0].prompt_logprobs[1]
    assert len(first.top) == 2 and first.rank >= 1 and (first.rank == 1) == (first.token_id == first.top[0][0])


def test_a_cached_prefix_is_recomputed_not_skipped(
    smol_loaded: LoadedModel, prompt: list[int], reference: torch.Tensor
) -> None:
    engine = engine_for(smol_loaded)
    run(engine, {"warm": (prompt, SamplingParams(max_tokens=1))})  # the prompt's blocks are now cached
    deltas = all_deltas(engine, {"a": (prompt, SamplingParams(max_tokens=2, prompt_logprobs=0))})["a"]
    assert (scored(deltas) - reference).abs().max() < TOLERANCE
    assert deltas[-1].num_cached_tokens == 0


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(
    smol_loaded: LoadedModel, prompt: list[int], reference: torch.Tensor
) -> None:
    engine = engine_for(smol_loaded, max_num_batched_tokens=16)
    deltas = all_deltas(engine, {"a": (prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))})["a"]
    assert [d.new_token_ids for d in deltas] == [[]] and deltas[0].finish_reason == "length"
    assert (scored(deltas) - reference).abs().max() < TOLERANCE
    assert engine.kv.pool.num_free == engine.kv.num_blocks and not engine.has_unfinished_requests()


def test_parallel_samples_share_the_prompt_scores(smol_loaded: LoadedModel, prompt: list[int]) -> None:
    engine = engine_for(smol_loaded)
    params = SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1, prompt_logprobs=0)
    deltas = all_deltas(engine, {"a": (prompt, params)})["a"]
    assert torch.equal(scored(deltas, 0), scored(deltas, 1)) and torch.equal(scored(deltas, 0), scored(deltas, 2))


def test_a_long_prompt_scores_over_steps_within_the_token_budget(
    smol_loaded: LoadedModel, prompt: list[int], reference: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scored prompt token costs two of a step's budget (its forward row and its LM-head row): no step does
    more rows than the budget, the scoring spreads over steps, and a decoding request keeps its turn in each."""
    budget = 16
    steps: list[tuple[int, int]] = []  # (forward rows, scored rows) of each step that scores
    real_score = model_runner.score

    def recording(logits: LogitsFunction, hidden: torch.Tensor, wanted: list[PromptRows]) -> dict[str, list]:
        steps.append((len(hidden), sum(len(w.rows) for w in wanted)))
        return real_score(logits, hidden, wanted)

    monkeypatch.setattr(model_runner, "score", recording)
    engine = engine_for(smol_loaded, max_num_batched_tokens=budget)
    engine.add_request("decode", prompt[:5], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.add_request("score", prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    deltas, decoded = [], []
    while "score" in engine.request_ids():
        step = engine.step()
        deltas += [d for d in step if d.request_id == "score"]
        decoded.append(any(d.request_id == "decode" for d in step))
    assert all(forward + rows <= budget for forward, rows in steps), steps
    assert sum(rows for _, rows in steps) == len(prompt) - 1 and len(steps) >= 2 * len(prompt) // budget
    assert all(decoded)
    assert (scored(deltas) - reference).abs().max() < TOLERANCE


def chunk_sizes(request: Request, budget: int) -> list[int]:
    """The tokens each step gives a lone request, its prompt logprobs filled in as the engine would."""
    scheduler = Scheduler(KVCacheManager(num_blocks=32, block_size=4), 4, budget, max_model_len=64, max_queue_len=4)
    scheduler.add_request(request)
    sizes = []
    while request.num_computed_tokens < request.num_tokens:
        out = scheduler.schedule()
        (item,) = out.scheduled
        positions = scored_positions(
            request.num_computed_tokens, item.num_new_tokens, len(request.prompt_logprobs), request.num_prompt_tokens
        )
        request.prompt_logprobs += [TokenLogprob(0, 0.0)] * len(positions)
        scheduler.update(out, {})
        sizes.append(item.num_new_tokens)
    return sizes


def test_a_scored_token_costs_two_of_the_budget_and_one_once_scored() -> None:
    """24 of 25 prompt tokens are scored: 5 a step in a budget of 10 (the last one's 4 + the unscored token).
    Recomputed after a preemption, the 10 tokens scored already cost one each."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    assert chunk_sizes(Request("a", list(range(100, 125)), params, max_tokens=1), budget=10) == [5, 5, 5, 5, 5]
    preempted = Request("b", list(range(100, 125)), params, max_tokens=1)
    preempted.prompt_logprobs = [TokenLogprob(0, 0.0)] * 10
    assert chunk_sizes(preempted, budget=10) == [10, 5, 5, 5]
    assert chunk_sizes(Request("c", list(range(100, 125)), params, max_tokens=1), budget=1) == [1] * 25
    assert chunk_sizes(Request("d", list(range(100, 125)), SamplingParams(max_tokens=1), 1), budget=10) == [10, 10, 5]


def test_max_tokens_0_needs_n_1() -> None:
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(max_tokens=0, n=2)


# ---- through the server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(smol_loaded: LoadedModel) -> Iterator[str]:
    with served_engine(
        EngineConfig(num_kv_blocks=64, max_num_batched_tokens=32, activation_dtype="float32"),
        smol_loaded,
        ServerSettings([MODEL]),
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none")


def test_echo_scoring_like_lm_evaluation_harness(
    client: openai.OpenAI, prompt: list[int], reference: torch.Tensor
) -> None:
    """What `local-completions` sends for loglikelihoods: echo, logprobs=1, max_tokens=0, token ids as prompt."""
    reply = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0)
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert len(choice.logprobs.tokens) == len(prompt) and "".join(choice.logprobs.tokens) == choice.text
    ours = torch.tensor(choice.logprobs.token_logprobs[1:])
    assert (ours - reference).abs().max() < TOLERANCE
    assert abs(float(ours.sum() - reference.sum())) < 1e-3  # a sequence's loglikelihood
    # The top 1 and the token itself (OpenAI: up to logprobs+1 entries); the harness's greedy check takes the max.
    tops = zip(choice.logprobs.tokens[1:], choice.logprobs.top_logprobs[1:])
    assert all(len(top) in (1, 2) and token in top for token, top in tops)
    assert choice.logprobs.text_offset[:2] == [0, len(choice.logprobs.tokens[0])]
    assert reply.usage is not None and reply.usage.completion_tokens == 0


def test_echo_with_logprobs_and_generation_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Once upon a time", echo=True, logprobs=2, max_tokens=4, temperature=0)
    whole = client.completions.create(**kwargs).choices[0]  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert text == whole.text and text.startswith("Once upon a time")
    assert whole.logprobs is not None and tokens == whole.logprobs.tokens
    num_prompt = len(whole.logprobs.tokens) - 4
    assert whole.logprobs.token_logprobs[0] is None and None not in whole.logprobs.token_logprobs[1:]
    assert whole.logprobs.text_offset[num_prompt] == len("Once upon a time")


def test_vllm_prompt_logprobs_on_both_endpoints(url: str) -> None:
    body = {"model": MODEL, "max_tokens": 1, "prompt_logprobs": 1}
    completion = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "Hello there"}).json()
    entries = completion["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and all(1 <= len(e) <= 2 for e in entries[1:])
    some = next(iter(entries[1].values()))
    assert set(some) == {"logprob", "rank", "decoded_token"}
    chat = httpx.post(f"{url}/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["prompt_logprobs"][0] is None
    streamed = httpx.post(
        f"{url}/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    )
    assert streamed.status_code == 400 and streamed.json()["error"]["code"] == "unsupported_parameter"


def test_vllm_prompt_logprobs_are_plain_dicts() -> None:
    """63,000 entries for 3,000 prompt tokens with their top 20: as pydantic models they held the server's event
    loop (every stream's next chunk) for a second; as dicts they cost a tenth, and the answer's JSON is the same."""
    items = [None, TokenLogprob(5, -1.5, [(7, -0.5), (5, -1.5)], 2)]
    out = vllm_prompt_logprobs(items, lambda token_id: f"<{token_id}>")
    assert out == [
        None,
        {
            "5": {"logprob": -1.5, "rank": 2, "decoded_token": "<5>"},
            "7": {"logprob": -0.5, "rank": 1, "decoded_token": "<7>"},
        },
    ]
    assert all(type(entry) is dict for entry in (out[1] or {}).values())
    choice = CompletionChoice(index=0, text="", prompt_logprobs=out)
    assert json.loads(choice.model_dump_json())["prompt_logprobs"] == out
