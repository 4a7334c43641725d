"""llama.cpp's tools/server/tests/unit/test_chat_completion.py and test_basic.py (/props), against transformers'
chat template where llama.cpp compares with its own renderer."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedserve.engine.worker.model_loader import LoadedModel
from tests.peers.conftest import MODEL, post

BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


def chat(url: str, **body: object) -> httpx.Response:
    return post(url, "/v1/chat/completions", **{"model": MODEL, "messages": BOOK, "max_tokens": 8, **body})


def test_chat_completion_counts_the_templated_prompt(url: str, smol_loaded: LoadedModel) -> None:
    tokenizer = smol_loaded.tokenizer
    body = chat(url).json()
    expected = len(tokenizer.apply_chat_template(BOOK, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert "cmpl" in body["id"] and body["usage"]["prompt_tokens"] == expected
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["role"] == "assistant"
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]
    assert chat(url, messages=[BOOK[0], {"role": "user", "content": parts}]).status_code == 200


def test_chat_completion_stream(url: str) -> None:
    events = []
    body = {
        "model": MODEL,
        "messages": BOOK,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    first, *rest = events
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert len({event["id"] for event in events}) == 1
    assert all("role" not in e["choices"][0]["delta"] for e in rest if e["choices"])
    finish = [e for e in rest if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and "content" not in finish[0]["choices"][0]["delta"]
    assert rest[-1]["choices"] == [] and rest[-1]["usage"]["completion_tokens"] == 8


def test_chat_completion_with_openai_library(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=BOOK, max_tokens=8, seed=42, temperature=0.8)  # type: ignore[arg-type]
    assert answer.system_fingerprint and answer.choices[0].finish_reason == "length"
    assert answer.choices[0].message.content


def test_continue_final_message_and_its_mutual_exclusion(url: str, smol_loaded: LoadedModel) -> None:
    prefilled = [*BOOK, {"role": "assistant", "content": "Whill"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    template = post(url, "/apply-template", messages=prefilled, **flags).json()["prompt"]
    assert template.endswith("<|im_start|>user\nWhat is the best book<|im_end|>\n<|im_start|>assistant\nWhill")
    assert chat(url, messages=prefilled, **flags).status_code == 200
    assert chat(url, messages=prefilled, add_generation_prompt=True, continue_final_message=True).status_code == 400


def test_apply_template_is_transformers_rendering(url: str, smol_loaded: LoadedModel) -> None:
    messages = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
    prompt = post(url, "/apply-template", messages=messages).json()["prompt"]
    assert prompt == smol_loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize(
    ("constraint", "expected"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": "foo"}}}},
            '"foo"',
        ),
        ({"json_schema": {"const": "42"}}, '"42"'),
        ({"grammar": 'root ::= "yes" | "no"'}, None),
    ],
)
def test_constrained_chat(url: str, constraint: dict, expected: str | None) -> None:
    content = chat(url, max_tokens=10, **constraint).json()["choices"][0]["message"]["content"]
    assert content == expected if expected is not None else content in ("yes", "no")


def test_invalid_grammar_is_400(url: str) -> None:
    answer = chat(url, grammar="root ::= this is (not valid GBNF")
    assert answer.status_code == 400 and "error" in answer.json()


@pytest.mark.parametrize(
    "messages",
    [None, "string", [123], [{}], [{"role": 123}], [{"role": "system", "content": 123}], [BOOK[0], {}]],
)
def test_invalid_chat_request_is_400(url: str, messages: object) -> None:
    answer = post(url, "/v1/chat/completions", model=MODEL, messages=messages)
    assert answer.status_code == 400 and "error" in answer.json()


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs(client: openai.OpenAI, stream: bool) -> None:
    ask = {"model": MODEL, "messages": BOOK, "max_tokens": 5, "temperature": 0.0, "logprobs": True, "top_logprobs": 10}
    if stream:
        chunks = [c.choices[0] for c in client.chat.completions.create(**ask, stream=True) if c.choices]  # type: ignore[call-overload]
        text = "".join(choice.delta.content or "" for choice in chunks)
        tokens = [token for choice in chunks if choice.logprobs for token in choice.logprobs.content or []]
    else:
        choice = client.chat.completions.create(**ask).choices[0]  # type: ignore[call-overload]
        text, tokens = choice.message.content, choice.logprobs.content
    assert "".join(token.token for token in tokens) == text
    assert all(token.logprob <= 0.0 and token.bytes is not None and len(token.top_logprobs) == 10 for token in tokens)


def test_logit_bias(url: str, client: openai.OpenAI) -> None:
    exclude = ["the", "The", "a", "is", "to", "and", "of", "I", "it", "book", "Book"]
    tokens = post(url, "/tokenize", content=" " + " ".join(exclude) + " ").json()["tokens"]
    answer = client.chat.completions.create(
        model=MODEL,
        messages=BOOK,
        max_tokens=32,
        temperature=0.0,
        logit_bias={str(t): -100 for t in tokens},  # type: ignore[arg-type]
    )
    text = answer.choices[0].message.content or ""
    assert text and not set(post(url, "/tokenize", content=text).json()["tokens"]) & set(tokens)


def test_context_size_exceeded(url: str) -> None:
    answer = chat(url, messages=BOOK * 2000)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"


def test_multiple_choices(url: str) -> None:
    for _ in range(2):
        body = chat(url, n=2, max_tokens=4, temperature=1.0).json()
        assert [choice["index"] for choice in body["choices"]] == [0, 1]
        assert body["usage"]["completion_tokens"] == 8


def test_props(url: str, smol_loaded: LoadedModel) -> None:
    props = httpx.get(f"{url}/props", timeout=60).json()
    assert props["total_slots"] == 8 and props["chat_template"] == smol_loaded.tokenizer.chat_template
    defaults = props["default_generation_settings"]
    assert defaults["n_ctx"] > 0 and defaults["params"]["temperature"] == 0.8 and defaults["params"]["top_k"] == 40
    models = httpx.get(f"{url}/v1/models", timeout=60).json()
    assert [model["id"] for model in models["data"]] == [MODEL]
