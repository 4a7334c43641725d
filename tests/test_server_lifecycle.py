"""Start-up, shutdown and failure: /ready and /health, a dead engine thread, a failing step."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from pagedserve.engine import EngineConfig, LLMEngine, SequenceDelta
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import create_app
from pagedserve.server.context import ServingContext
from tests.background import BackgroundServer

CONFIG = EngineConfig(num_kv_blocks=32)
CHAT = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30}


@dataclass
class Served:
    engine: AsyncEngine
    url: str
    context: ServingContext


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[], LLMEngine]], Served]]:
    """Starts an engine from a factory and a server in front of it; stops both after the test."""
    with contextlib.ExitStack() as stack:

        def start(make_engine: Callable[[], LLMEngine]) -> Served:
            engine = AsyncEngine.in_thread(make_engine).start()
            stack.callback(engine.shutdown)
            app = create_app(engine)
            server = stack.enter_context(BackgroundServer(app))
            return Served(engine, server.url, app.state.serving)

        yield start


def sse_data(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_ready_only_once_the_model_has_loaded(serve: Callable, smol_loaded: LoadedModel) -> None:
    may_load = threading.Event()

    def slow_load() -> LLMEngine:
        may_load.wait(30)
        return LLMEngine(CONFIG, smol_loaded)

    served = serve(slow_load)
    engine, url = served.engine, served.url
    assert httpx.get(f"{url}/ready").status_code == 503
    assert httpx.get(f"{url}/health").status_code == 200  # loading is alive
    response = httpx.post(f"{url}/v1/chat/completions", json=CHAT)
    assert response.status_code == 503 and response.headers["retry-after"]
    assert response.json()["error"]["code"] == "engine_unavailable"
    assert httpx.get(f"{url}/v1/models").status_code == 503
    may_load.set()
    assert engine.wait_ready(30)
    assert httpx.get(f"{url}/ready").status_code == 200
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60).status_code == 200


def test_ready_turns_503_while_draining(serve: Callable, smol_loaded: LoadedModel) -> None:
    served = serve(lambda: LLMEngine(CONFIG, smol_loaded))
    assert served.engine.wait_ready(30)
    served.context.draining = True  # what the CLI's server does when shutdown begins
    assert httpx.get(f"{served.url}/ready").status_code == 503
    assert httpx.post(f"{served.url}/v1/chat/completions", json=CHAT).status_code == 503


def test_failed_load_makes_health_fail(serve: Callable) -> None:
    def broken_load() -> LLMEngine:
        raise FileNotFoundError("no such model")

    served = serve(broken_load)
    engine, url = served.engine, served.url
    assert not engine.wait_ready(30)
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and "no such model" in health.json()["reason"]
    assert httpx.get(f"{url}/ready").status_code == 503


def test_engine_thread_death_ends_streams_with_an_error_event(serve: Callable, smol_loaded: LoadedModel) -> None:
    llm = LLMEngine(CONFIG, smol_loaded)
    real_step, steps = llm.step, 0

    def step_then_die() -> list[SequenceDelta]:
        nonlocal steps
        steps += 1
        if steps > 3:
            raise SystemError("scheduler corrupted")
        return real_step()

    llm.step = step_then_die  # type: ignore[method-assign]
    served = serve(lambda: llm)
    engine, url = served.engine, served.url
    assert engine.wait_ready(30)
    data = sse_data(url, {**CHAT, "ignore_eos": True})
    assert "[DONE]" not in data
    assert json.loads(data[-1])["error"]["code"] == "engine_unavailable"
    assert httpx.get(f"{url}/health").status_code == 503


def test_a_failed_step_fails_its_requests_not_the_server(serve: Callable, smol_loaded: LoadedModel) -> None:
    llm = LLMEngine(CONFIG, smol_loaded)
    real_execute, calls = llm.runner.execute, 0

    def execute_then_fail(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls in (3, 4):
            raise RuntimeError("device lost")
        return real_execute(*args, **kwargs)

    llm.runner.execute = execute_then_fail  # type: ignore[method-assign]
    served = serve(lambda: llm)
    engine, url = served.engine, served.url
    assert engine.wait_ready(30)
    data = sse_data(url, {**CHAT, "ignore_eos": True})
    error = json.loads(data[-1])["error"]
    assert error["code"] == "engine_error" and "device lost" in error["message"]
    response = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "ignore_eos": True}, timeout=60)
    assert response.status_code == 500 and response.json()["error"]["code"] == "engine_error"
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
