"""Every error answer: OpenAI's JSON shape, status, type and code; auth; the queue-full 503."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from pagedserve.engine import EngineConfig
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.server import ServerSettings
from tests.servers import engine_and_url, serving

MODEL = "smol"
KEY = "s3cret"
HELLO = [{"role": "user", "content": "Hi"}]
# A 128-token context (8 blocks of 16), one running sequence and one waiting: limits are cheap to reach.
CONFIG = EngineConfig(num_kv_blocks=8, max_num_seqs=1, max_queue_len=1)


engine, url = engine_and_url(CONFIG, ServerSettings([MODEL]))


@pytest.fixture(scope="module")
def secured_url(engine: AsyncEngine) -> Iterator[str]:
    with serving(engine, ServerSettings([MODEL], api_key=KEY)) as url:
        yield url


def assert_error(response: httpx.Response, status: int, code: str | None, param: str | None = None) -> str:
    """Checks the OpenAI error shape; returns the message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert error["code"] == code and error["param"] == param and error["message"]
    assert response.headers["x-request-id"]
    return error["message"]


def chat(url: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": HELLO, **body}, timeout=60)


def complete(url: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)


def test_malformed_json_is_400(url: str) -> None:
    response = httpx.post(
        f"{url}/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert_error(response, 400, "invalid_json")


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"model": None}, "invalid_type", "model"),
        ({"temperature": 3}, "invalid_value", "temperature"),
        ({"top_p": 0}, "invalid_value", "top_p"),
        ({"n": 17}, "invalid_value", "n"),
        ({"max_tokens": 0}, "invalid_value", "max_tokens"),
        ({"presence_penalty": 9}, "invalid_value", "presence_penalty"),
        ({"logit_bias": {"99999999": 1}}, "invalid_value", "logit_bias"),
        ({"top_logprobs": 2}, "invalid_value", "top_logprobs"),
        ({"messages": []}, "empty_array", "messages"),
        ({"messages": [{"role": "robot<|im_end|>", "content": "Hi"}]}, "invalid_value", "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "invalid_value", "messages.0.content"),
        ({"messages": [{"role": "user", "content": 5}]}, "invalid_type", "messages.0.content"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "invalid_value", "tools.0.function.name"),
        ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
        ({"response_format": {"type": "xml"}}, "invalid_value", "response_format"),
    ],
)
def test_bad_chat_requests_are_400(url: str, body: dict, code: str, param: str) -> None:
    assert_error(chat(url, **body), 400, code, param)


def test_missing_model_is_400_and_unknown_model_404(url: str) -> None:
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": HELLO})
    assert_error(response, 400, "missing_required_parameter", "model")
    assert_error(chat(url, model="gpt-4o"), 404, "model_not_found", "model")


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"prompt": "Hi", "suffix": "end"}, "unsupported_parameter", "suffix"),
        ({"prompt": []}, "empty_array", "prompt"),
        ({"prompt": [1, "a"]}, "invalid_type", "prompt"),
        ({"prompt": [10**9]}, "invalid_value", "prompt"),
        ({"prompt": "Hi", "stop": [""]}, "invalid_value", "stop"),
    ],
)
def test_bad_completion_requests_are_400(url: str, body: dict, code: str, param: str) -> None:
    assert_error(complete(url, **body), 400, code, param)


def test_prompt_too_long_names_both_lengths(url: str) -> None:
    message = assert_error(complete(url, prompt=[42] * 200), 400, "context_length_exceeded", "prompt")
    assert "200" in message and "128" in message
    long_chat = [{"role": "user", "content": "word " * 200}]
    assert_error(chat(url, messages=long_chat), 400, "context_length_exceeded", "messages")


def test_max_tokens_is_clamped_to_the_room_left(url: str) -> None:
    response = complete(url, prompt=[42] * 124, max_tokens=128, ignore_eos=True)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
    message = assert_error(complete(url, prompt="Hi", max_tokens=129), 400, "invalid_value", "max_tokens")
    assert "128" in message  # more than the whole context can never fit


def test_full_queue_is_503_with_retry_after(url: str) -> None:
    long_run = {"messages": HELLO, "max_tokens": 90, "ignore_eos": True, "stream": True, "model": MODEL}
    endpoint = f"{url}/v1/chat/completions"
    with httpx.stream("POST", endpoint, json=long_run, timeout=60) as running:
        lines = (line for line in running.iter_lines() if line.startswith("data:"))
        next(lines), next(lines)  # the role chunk, then the first token's: it runs, the queue is empty
        with httpx.stream("POST", endpoint, json=long_run, timeout=60) as waiting:
            assert waiting.status_code == 200  # queued: the stream is open
            response = chat(url, max_tokens=1)
            assert_error(response, 503, "queue_full")
            assert response.headers["retry-after"] == "1"


def test_unknown_route_and_wrong_method(url: str) -> None:
    assert_error(httpx.get(f"{url}/v1/nothing"), 404, "not_found")
    assert_error(httpx.get(f"{url}/v1/chat/completions"), 405, "method_not_allowed")


def test_api_key_guards_every_route_but_probes_and_metrics(secured_url: str) -> None:
    assert_error(httpx.get(f"{secured_url}/v1/models"), 401, "invalid_api_key")
    wrong = {"Authorization": "Bearer nope"}
    assert_error(httpx.post(f"{secured_url}/tokenize", json={"prompt": "a"}, headers=wrong), 401, "invalid_api_key")
    assert_error(httpx.post(f"{secured_url}/reset_prefix_cache"), 401, "invalid_api_key")
    right = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{secured_url}/v1/models", headers=right).status_code == 200
    assert httpx.post(f"{secured_url}/reset_prefix_cache", headers=right).status_code == 200
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{secured_url}{path}").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{secured_url}/v1", api_key="nope", max_retries=0).models.list()
    sdk = openai.OpenAI(base_url=f"{secured_url}/v1", api_key=KEY, max_retries=0)
    assert sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).choices


def test_no_api_key_needed_when_none_is_set(url: str) -> None:
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer anything"}).status_code == 200
