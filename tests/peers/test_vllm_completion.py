"""vLLM's tests/entrypoints/openai completion suite (test_completion.py, test_return_token_ids.py), for
/v1/completions through the openai SDK; token counts checked against transformers instead of vLLM's model's."""

from __future__ import annotations

import openai
import pytest

from pagedserve.engine.worker.model_loader import LoadedModel
from tests.peers.conftest import MODEL

IDS = [1, 2, 3, 4, 5]


def test_single_completion(client: openai.OpenAI, smol_loaded: LoadedModel) -> None:
    answer = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5, temperature=0.0)
    assert answer.id and len(answer.choices) == 1 and answer.choices[0].finish_reason == "length"
    n_prompt = len(smol_loaded.tokenizer.encode("Hello, my name is"))
    assert answer.usage is not None and (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (n_prompt, 5)
    assert answer.usage.total_tokens == n_prompt + 5 and answer.usage.prompt_tokens_details is not None
    by_ids = client.completions.create(model=MODEL, prompt=IDS, max_tokens=5, temperature=0.0)
    assert by_ids.choices[0].text and getattr(by_ids.choices[0], "prompt_logprobs", None) is None


@pytest.mark.parametrize(("logprobs", "sizes"), [(None, None), (0, (1, 1)), (5, (5, 6))])
def test_logprobs(client: openai.OpenAI, logprobs: int | None, sizes: tuple[int, int] | None) -> None:
    choice = client.completions.create(
        model=MODEL, prompt=IDS, max_tokens=5, temperature=0.0, logprobs=logprobs
    ).choices[0]
    if sizes is None:
        assert choice.logprobs is None
        return
    assert choice.logprobs is not None and choice.logprobs.top_logprobs and choice.logprobs.token_logprobs
    assert sizes[0] <= len(choice.logprobs.top_logprobs[0]) <= sizes[1]


def test_too_many_logprobs_and_the_server_carries_on(client: openai.OpenAI) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=IDS, max_tokens=5, logprobs=21, stream=stream)
    assert client.completions.create(model=MODEL, prompt=IDS, max_tokens=5).choices[0].text is not None


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])
def test_prompt_logprobs(client: openai.OpenAI, prompt_logprobs: int | None) -> None:
    ask: dict = {"model": MODEL, "prompt": ["A robot may not injure another robot", "My name is"], "max_tokens": 4}
    if prompt_logprobs is not None:
        ask["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**ask)
        return
    answer = client.completions.create(**ask)
    for choice in answer.choices:
        scored = getattr(choice, "prompt_logprobs", None)
        assert (scored is None) == (prompt_logprobs is None) and (scored is None or len(scored) > 0)


def test_streaming_matches_the_whole_answer(client: openai.OpenAI) -> None:
    ask = {"model": MODEL, "prompt": "What is an LLM?", "max_tokens": 5, "temperature": 0.0}
    whole = client.completions.create(**ask).choices[0]
    chunks = list(client.completions.create(**ask, stream=True))
    assert sum(chunk.choices[0].finish_reason is not None for chunk in chunks) == 1
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason  # vLLM's model runs to the length
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.text


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_sampling(client: openai.OpenAI, stream: bool) -> None:
    ask = {
        "model": MODEL,
        "prompt": "Once upon a time, there was",
        "max_tokens": 30,
        "n": 3,
        "temperature": 1.0,
        "seed": 42,
    }
    texts = [""] * 3
    if stream:
        finished = 0
        for chunk in client.completions.create(**ask, stream=True):
            texts[chunk.choices[0].index] += chunk.choices[0].text
            finished += chunk.choices[0].finish_reason is not None
        assert finished == 3
    else:
        answer = client.completions.create(**ask, logprobs=0)
        assert [choice.index for choice in answer.choices] == [0, 1, 2]
        texts = [choice.text for choice in answer.choices]
    assert len(set(texts)) == 3


def test_stream_options(client: openai.OpenAI) -> None:
    ask = {"model": MODEL, "prompt": "What is the capital of France?", "max_tokens": 5, "temperature": 0.0}
    for options in ({"include_usage": False, "continuous_usage_stats": False}, {"include_usage": False}, {}):
        assert all(c.usage is None for c in client.completions.create(**ask, stream=True, stream_options=options))  # type: ignore[arg-type]
    chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert all(chunk.usage is None for chunk in chunks[:-1])
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None and final.usage.completion_tokens > 0
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
    continuous = {"include_usage": True, "continuous_usage_stats": True}
    for chunk in client.completions.create(**ask, stream=True, stream_options=continuous):  # type: ignore[arg-type]
        assert chunk.usage is not None and chunk.usage.prompt_tokens > 0 and chunk.usage.completion_tokens > 0
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    for options in ({"include_usage": None}, {"include_usage": True}, {"continuous_usage_stats": True}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**ask, stream=False, stream_options=options)  # type: ignore[arg-type]


def test_batch_completions(client: openai.OpenAI) -> None:
    for prompts in (["Hello, my name is"] * 2, [IDS] * 2):
        batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0.0)  # type: ignore[arg-type]
        assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text
        texts = ["", ""]
        for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0.0, stream=True):  # type: ignore[arg-type]
            assert len(chunk.choices) == 1
            texts[chunk.choices[0].index] += chunk.choices[0].text
        assert texts[0] == texts[1] == batch.choices[0].text


@pytest.mark.parametrize("logprobs", [1, 0])
def test_echo_logprobs(client: openai.OpenAI, smol_loaded: LoadedModel, logprobs: int) -> None:
    for prompt in ("Hello, my name is", IDS):
        choice = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0, echo=True, logprobs=logprobs
        ).choices[0]
        text = smol_loaded.tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
        assert choice.text.startswith(text) and choice.logprobs is not None
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None  # type: ignore[index]
        assert all(max(logprobs, 1) <= len(top) <= logprobs + 1 for top in choice.logprobs.top_logprobs[1:])  # type: ignore[index]


@pytest.mark.parametrize(
    "constraint",
    [
        {"json": {"properties": {"foo": "bar"}, "type": "object"}},
        {"regex": r"[.*"},
        {"grammar": "root ::= select_statementinvalidsyntax"},
    ],
    ids=["json", "regex", "grammar"],
)
def test_invalid_constraints_are_400(client: openai.OpenAI, constraint: dict) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, extra_body={"structured_outputs": constraint})


def test_return_token_ids_align_with_logprobs(client: openai.OpenAI, smol_loaded: LoadedModel) -> None:
    answer = client.completions.create(
        model=MODEL,
        prompt="Hello, world! How are you today?",
        max_tokens=8,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"return_token_ids": True, "prompt_logprobs": 1},
    )
    choice = answer.choices[0]
    extra = choice.model_extra or {}
    assert smol_loaded.tokenizer.decode(extra["prompt_token_ids"]).startswith("Hello, world")
    assert choice.text.endswith(smol_loaded.tokenizer.decode(extra["token_ids"], skip_special_tokens=True))
    assert choice.logprobs is not None and len(extra["token_ids"]) < len(choice.logprobs.tokens or [])
    without = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"return_token_ids": False})
    assert (without.choices[0].model_extra or {}).get("token_ids") is None
