"""Hostile input: schemathesis fuzzes every route of /openapi.json, then a hand-written list of nasty bodies.

Whatever arrives, the server answers it without a 5xx, every error in OpenAI's shape, and serves on afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from pagedserve.engine import EngineConfig, LLMEngine
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings, create_app
from tests.servers import served_engine

MODEL = "smol"
EXAMPLES = 25  # per route and mode
MAX_TOKENS = 4  # generated answers are capped: the fuzzer is after the validation paths, not long outputs
# A 128-token context (8 blocks of 16): long prompts hit the context limit cheaply.
CONFIG = EngineConfig(num_kv_blocks=8, max_num_seqs=8, max_queue_len=64, max_n=4)
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def url(smol_loaded: LoadedModel) -> Iterator[str]:
    with served_engine(CONFIG, smol_loaded, ServerSettings([MODEL])) as url:
        yield url


def assert_openai_error(response: httpx.Response | schemathesis.Response) -> None:
    """Every 4xx and 5xx is {"error": {"message", "type", "param", "code"}}, with a string code."""
    if response.status_code < 400:
        return
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["code"], str), f"{response.status_code} without a string code: {error}"
    assert error["type"] == ("invalid_request_error" if response.status_code < 500 else "server_error")


def never_loaded() -> LLMEngine:
    raise AssertionError("only the app's routes are needed")


# The routes, at collection: one test per route and mode.
SPEC = create_app(AsyncEngine.in_thread(never_loaded)).openapi()


def breakable(spec: dict) -> bool:
    """Negative cases need something to break: a body, or a parameter narrower than any string (a string path
    parameter, like /v1/models/{model_id}'s, takes every value a URL can carry)."""
    parameters = spec.get("parameters", [])
    return "requestBody" in spec or any(p.get("schema", {}).get("type") != "string" for p in parameters)


CASES = [
    pytest.param(method.upper(), path, mode, id=f"{method.upper()} {path} {mode}")
    for path, methods in SPEC["paths"].items()
    for method, spec in methods.items()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or breakable(spec)
]


def steer(body: Any) -> None:
    """Gets fuzzed bodies past the model check (a random name is just a 404) and keeps answers short, without
    hiding bad values: only strings become the served name, only valid large max_tokens shrink."""
    if not isinstance(body, dict) or "model" not in body:
        return
    if isinstance(body["model"], str):
        body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS


@pytest.fixture(scope="module")
def schema(url: str) -> schemathesis.BaseSchema:
    served = schemathesis.openapi.from_url(f"{url}/openapi.json")
    assert served.raw_schema["paths"].keys() == SPEC["paths"].keys()
    return served


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_fuzzed_requests_get_no_5xx_and_openai_errors(
    schema: schemathesis.BaseSchema, url: str, method: str, path: str, mode: GenerationMode
) -> None:
    api_operation = schema[path][method]

    @given(case=api_operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    def fuzz(case: schemathesis.Case) -> None:
        steer(case.body)
        response = case.call(base_url=url, timeout=60)
        assert response.status_code < 500, f"{response.status_code}: {response.text}"
        assert_openai_error(response)

    fuzz()


# ---- hand-written hostile input ------------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
DEEP = 100_000  # levels: past Python's recursion limit, under the body-size limit


def chat(**fields: object) -> tuple[str, bytes]:
    return CHAT, json.dumps({"model": MODEL, "messages": HI, "max_tokens": 2, **fields}).encode()


def completion(**fields: object) -> tuple[str, bytes]:
    return COMPLETIONS, json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}).encode()


HOSTILE = {
    # huge numbers
    "huge max_tokens": completion(max_tokens=10**30),
    "huge n": chat(n=10**20),
    "huge seed": completion(seed=10**40),
    "huge token id": completion(prompt=[10**30]),
    "huge logit_bias": completion(logit_bias={"1": 1e300}),
    "huge min_tokens": completion(min_tokens=10**20),
    "huge timeout": completion(timeout=1e309),
    "5000-digit integer": (COMPLETIONS, b'{"model": "smol", "prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}"),
    "float overflow": (COMPLETIONS, b'{"model": "smol", "prompt": "Hi", "temperature": 1e999}'),
    # NaN and infinities (Python's json reads these non-standard literals)
    "NaN temperature": (COMPLETIONS, b'{"model": "smol", "prompt": "Hi", "temperature": NaN}'),
    "NaN max_tokens": (COMPLETIONS, b'{"model": "smol", "prompt": "Hi", "max_tokens": NaN}'),
    "Infinity top_p": (CHAT, b'{"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "top_p": Infinity}'),
    "NaN timeout": (COMPLETIONS, b'{"model": "smol", "prompt": "Hi", "timeout": NaN}'),
    # negative values
    "negative max_tokens": chat(max_tokens=-1),
    "negative n": completion(n=-1),
    "negative top_logprobs": chat(logprobs=True, top_logprobs=-1),
    "negative logprobs": completion(logprobs=-5),
    "negative timeout": chat(timeout=-1),
    "negative token id": completion(prompt=[-1]),
    "negative stop token": completion(stop_token_ids=[-1]),
    "negative detokenize id": ("/detokenize", json.dumps({"tokens": [-1]}).encode()),
    # limits
    "n over max_n": chat(n=CONFIG.max_n + 1),
    "top_logprobs over 20": chat(logprobs=True, top_logprobs=21),
    "17 stop strings": completion(stop=[f"s{i}" for i in range(17)]),
    "a 257-character stop": completion(stop="x" * 257),
    "301 logit_bias entries": completion(logit_bias={str(i): 1 for i in range(301)}),
    # deep nesting
    "deep list": (COMPLETIONS, b'{"model": "smol", "prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    "deep object": (CHAT, b'{"model": "smol", "messages": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}"),
    "nested prompt lists": completion(prompt=[[[1, 2]]]),
    # encodings and control characters
    "invalid UTF-8": (COMPLETIONS, b'{"model": "smol", "prompt": "\xff\xfe\xfa"}'),
    "truncated UTF-8": (CHAT, b'{"model": "smol", "messages": [{"role": "user", "content": "\xe2\x82"}]}'),
    "raw control characters": (COMPLETIONS, b'{"model": "smol", "prompt": "a\x00b\x1bc"}'),
    "NUL in the model name": completion(model="smol\u0000"),
    # wrong types
    "body is an array": (CHAT, b"[]"),
    "body is null": (CHAT, b"null"),
    "body is a string": (COMPLETIONS, b'"prompt"'),
    "empty body": (CHAT, b""),
    "messages is a string": chat(messages="Hi"),
    "n is a word": completion(n="two"),  # "2" passes: pydantic reads numeric strings
    "stream is a word": completion(stream="maybe"),
    "stop is a number": completion(stop=5),
    "logit_bias is a list": completion(logit_bias=[1, 2]),
    "content is an object": chat(messages=[{"role": "user", "content": {"text": "Hi"}}]),
    "timeout is a string": chat(timeout="soon"),
    "tokens are floats": ("/detokenize", json.dumps({"tokens": [1.5]}).encode()),
    # empty arrays
    "no messages": chat(messages=[]),
    "empty prompt list": completion(prompt=[]),
    "empty token list": completion(prompt=[[]]),
    "empty prompt string in a list": completion(prompt=["Hi", ""]),
}


@pytest.mark.parametrize(("path", "body"), list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_input_gets_a_4xx_and_the_server_serves_on(url: str, path: str, body: bytes) -> None:
    response = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text}"
    assert_openai_error(response)
    healthy = httpx.post(f"{url}{COMPLETIONS}", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert healthy.status_code == 200, healthy.text


def test_a_10_mb_body_gets_413(url: str) -> None:
    body = {"model": MODEL, "prompt": "word " * 2_000_000}  # 10 MB
    response = httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=60)
    assert response.status_code == 413
    assert_openai_error(response)
    assert response.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{url}/ready").status_code == 200
