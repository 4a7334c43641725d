"""The OpenAI-compatible API end to end: a real uvicorn server, the embedded model, the openai SDK and httpx."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedserve.engine import EngineConfig
from pagedserve.server import ServerSettings
from tests.servers import engine_and_url

MODEL = "smol"
ALIAS = "smol-alias"
HELLO = [{"role": "user", "content": "Say hello."}]


engine, url = engine_and_url(EngineConfig(num_kv_blocks=128, max_num_seqs=16), ServerSettings([MODEL, ALIAS]))


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def sse_data(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order."""
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def stream_chat(url: str, **body: object) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_data(response)


def test_chat_completion(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    completion = raw.parse()
    assert raw.headers["x-request-id"]
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    assert completion.model == MODEL and completion.system_fingerprint.startswith("fp_")
    [choice] = completion.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    usage = completion.usage
    assert usage.completion_tokens <= 8 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_cached_tokens_and_reset_prefix_cache(client: openai.OpenAI, url: str) -> None:
    messages = [{"role": "system", "content": "Answer briefly. " * 24}, *HELLO]  # several full blocks

    def cached_tokens() -> int:
        usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return usage.prompt_tokens_details.cached_tokens or 0

    cached_tokens()
    assert cached_tokens() >= 64
    reset = httpx.post(f"{url}/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json()["forgotten_blocks"] >= 4
    assert cached_tokens() == 0


def test_chat_accepts_text_parts_and_aliases(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    completion = client.chat.completions.create(model=ALIAS, messages=messages, max_tokens=4)
    assert completion.model == MODEL and completion.choices[0].message.content is not None


def test_chat_stream_with_usage(url: str) -> None:
    events = stream_chat(
        url, messages=HELLO, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks[1:-2] if c["choices"][0]["delta"].get("content")]
    assert content and all(c["choices"][0]["finish_reason"] is None for c in content)
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] in ("stop", "length")
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] <= 6
    assert all(chunk["usage"] is None for chunk in chunks[:-1])


def test_stream_without_usage_sends_no_usage_field(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, stream=True))
    assert all(chunk.usage is None for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason is not None


def test_n_choices_stream_each_on_its_own_index(url: str) -> None:
    events = stream_chat(url, messages=HELLO, max_tokens=5, n=3, seed=1, stream=True)
    chunks = [json.loads(event) for event in events[:-1]]
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert [c["finish_reason"] for c in mine].count(None) == len(mine) - 1
        assert mine[-1]["finish_reason"] is not None


def test_n_choices(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, n=3, seed=3)
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    assert 3 <= completion.usage.completion_tokens <= 15


def test_stop_string(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    stop = free.choices[0].text.strip()[:2]
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text
    assert free.choices[0].text.startswith(stopped.choices[0].text)


def test_seed_reproduces_sampling(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        completion = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=seed
        )
        return completion.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(3)}) > 1


def test_chat_logprobs(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = completion.choices[0].logprobs.content
    assert 1 <= len(content) <= 4
    for item in content:
        assert item.logprob <= 0 and item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 3
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy picks the most likely


def test_completions_forms_echo_and_logprobs(client: openai.OpenAI, url: str) -> None:
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    completion = client.completions.create(
        model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=3, n=2, temperature=0, echo=True
    )
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert completion.choices[0].text.startswith("Hello") and completion.choices[2].text.startswith("Goodbye")
    by_ids = client.completions.create(model=MODEL, prompt=[tokens, tokens], max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_ids.choices[1].text == completion.choices[0].text.removeprefix("Hello")
    single = client.completions.create(model=MODEL, prompt=tokens, max_tokens=3, temperature=0, logprobs=2)
    logprobs = single.choices[0].logprobs
    assert "".join(logprobs.tokens) == single.choices[0].text
    assert logprobs.text_offset[0] == 0 and all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert single.usage.prompt_tokens == len(tokens)


def test_completions_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL, prompt=["Hi", "Yo"], max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 8
    finished = {c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason is not None}
    assert finished == {0, 1}


def test_tokenize_detokenize_round_trip(url: str) -> None:
    text = "Paged attention, continuous batching."
    tokenized = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 0 and tokenized["max_model_len"] > 0
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokenized["tokens"]}).json() == {
        "prompt": text,
        "content": text,
    }
    chat = httpx.post(f"{url}/tokenize", json={"messages": HELLO}).json()
    assert chat["count"] > tokenized["count"] // 2  # the chat template adds its own tokens


def test_models_version_and_probes(url: str) -> None:
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL, ALIAS]
    card = models["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "pagedserve" and card["max_model_len"] == 2048
    assert isinstance(card["created"], int)
    assert httpx.get(f"{url}/version").json()["version"]
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").status_code == 200


def test_request_id_is_echoed_and_may_repeat(client: openai.OpenAI) -> None:
    headers = {"X-Request-Id": "trace-42"}
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=HELLO, max_tokens=2, extra_headers=headers
        )
        assert raw.headers["x-request-id"] == "trace-42"
