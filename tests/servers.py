"""Engines and loopback servers for tests (and benchmarks): started once per module, always shut down."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings, create_app
from pagedserve.server.door import Door
from pagedserve.server.http_protocol import guarded_protocol
from pagedserve.server.settings import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS
from tests.background import BackgroundServer


@contextlib.contextmanager
def running_engine(config: EngineConfig, loaded: LoadedModel) -> Iterator[AsyncEngine]:
    engine = AsyncEngine.from_config(config, loaded).start()
    try:
        assert engine.wait_ready(60), engine.unavailable_reason()
        yield engine
    finally:
        engine.shutdown()


@dataclass(frozen=True)
class Limits:
    """The connection limits of `pagedserve serve`'s protocol (its flags' defaults unless a test needs others)."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    body_timeout: float = DEFAULT_BODY_TIMEOUT


@contextlib.contextmanager
def serving(engine: AsyncEngine, settings: ServerSettings, limits: Limits = Limits()) -> Iterator[str]:
    """The base URL of a uvicorn server on 127.0.0.1 in front of `engine`, with `pagedserve serve`'s protocol."""
    app = create_app(engine, settings)
    door = Door(app.state.serving)
    protocol = guarded_protocol(limits.header_timeout, limits.max_connections, door, limits.body_timeout)
    with BackgroundServer(app, http=protocol) as server:
        yield server.url


@contextlib.contextmanager
def served_engine(config: EngineConfig, loaded: LoadedModel, settings: ServerSettings) -> Iterator[str]:
    """A fresh engine behind a fresh server; yields the server's base URL."""
    with running_engine(config, loaded) as engine, serving(engine, settings) as url:
        yield url


def engine_and_url(
    config: EngineConfig, settings: ServerSettings, loaded: str = "smol_loaded", limits: Limits = Limits()
) -> tuple[Any, Any]:
    """A test module's `engine` fixture (an AsyncEngine on the session's model fixture named `loaded`) and `url`
    fixture (a server in front of it, with these connection limits, the base URL), one per module:
    `engine, url = engine_and_url(...)`."""

    @pytest.fixture(scope="module")
    def engine(request: pytest.FixtureRequest) -> Iterator[AsyncEngine]:
        with running_engine(config, request.getfixturevalue(loaded)) as engine:
            yield engine

    @pytest.fixture(scope="module")
    def url(engine: AsyncEngine) -> Iterator[str]:
        with serving(engine, settings, limits) as url:
            yield url

    return engine, url


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, for a server process to take."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_ready(process: subprocess.Popen, url: str, timeout: float) -> bool:
    """Polls `url`/ready until it answers 200 (True), or until `process` exits or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return False


@contextlib.contextmanager
def server_process(
    command: list[str], url: str, log: Path, startup_seconds: float, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """`command` (a `pagedserve serve`) in a process of its own, logging to `log`, once `url` is ready; terminated
    (killed if it will not stop) on the way out. `env`: variables added to this process's environment."""
    with log.open("w") as sink:
        process = subprocess.Popen(
            command,
            cwd=Path(__file__).resolve().parents[1],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env},
        )
    try:
        if not wait_ready(process, url, startup_seconds):
            raise RuntimeError(f"the server did not become ready:\n{log.read_text()[-3000:]}")
        yield process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
