"""A large answer is formatted off the event loop: while a scored prompt's logprobs are formatted, the server goes
on answering (other streams, probes). Once, 63,000 prompt-logprob entries held the loop ~1 s per answer.

The formatting is made slow on purpose (a pure-Python wait inside it) so that the test reads the same on a busy
machine: the server must answer /health while it runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from pagedserve.engine import EngineConfig
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings
from pagedserve.server.completions import handler
from tests.servers import served_engine

MODEL = "tiny"
FORMATTING_SECONDS = 2.0
RESPONSIVE_SECONDS = 0.5  # /health's answer while the formatting runs; it waited for all of it before
PROMPT = list(range(100, 400))


@pytest.fixture(scope="module")
def url(tiny_llama_loaded: LoadedModel) -> Iterator[str]:
    config = EngineConfig(num_kv_blocks=64, max_num_batched_tokens=128)
    with served_engine(config, tiny_llama_loaded, ServerSettings([MODEL])) as url:
        yield url


def slowed(monkeypatch: pytest.MonkeyPatch, name: str) -> threading.Event:
    """Makes the handler's formatter `name` busy for FORMATTING_SECONDS first; the event is set when it starts."""
    started = threading.Event()
    original: Callable = getattr(handler, name)

    def busy(*args: object) -> object:
        started.set()
        until = time.perf_counter() + FORMATTING_SECONDS
        while time.perf_counter() < until:
            pass
        return original(*args)

    monkeypatch.setattr(handler, name, busy)
    return started


@pytest.mark.parametrize(
    ("formatter", "fields"),
    [
        ("vllm_prompt_logprobs", {"prompt_logprobs": 5}),
        ("vllm_prompt_logprobs", {"prompt_logprobs": 5, "stream": True}),
        ("echoed_prompt_logprobs", {"echo": True, "logprobs": 5}),
        ("echoed_prompt_logprobs", {"echo": True, "logprobs": 5, "stream": True}),
    ],
    ids=["prompt_logprobs", "prompt_logprobs streamed", "echo", "echo streamed"],
)
def test_the_server_answers_while_a_scored_prompt_is_formatted(
    url: str, monkeypatch: pytest.MonkeyPatch, formatter: str, fields: dict
) -> None:
    started = slowed(monkeypatch, formatter)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, **fields}
    answers: list[httpx.Response] = []
    scoring = threading.Thread(
        target=lambda: answers.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60))
    )
    scoring.start()
    assert started.wait(60)
    before = time.monotonic()
    health = httpx.get(f"{url}/health", timeout=60)
    waited = time.monotonic() - before
    scoring.join()
    assert health.status_code == 200 and answers[0].status_code == 200, answers[0].text
    assert waited < RESPONSIVE_SECONDS, f"/health waited {waited:.2f} s for the formatting"
    if not fields.get("stream"):
        choice = answers[0].json()["choices"][0]
        scored = choice["prompt_logprobs"] if "prompt_logprobs" in fields else choice["logprobs"]["token_logprobs"]
        assert len(scored) == len(PROMPT) + ("echo" in fields)  # echo: the generated token follows
