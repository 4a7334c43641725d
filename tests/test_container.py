"""The CPU image, built from this checkout and run for real: one container with the image's own CMD answers a
chat, runs the native kernels as a non-root user, turns healthy, and survives `docker stop` with Docker's
defaults: every stream ends cleanly and the server exits 0 inside the 10 s grace.

Docker's layer cache keeps rebuilds to seconds when only code changed (see the Dockerfile's stages).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.containers import Container, built_image, docker, start_container

pytestmark = pytest.mark.container

STARTUP_SECONDS = 180  # a fresh container compiles the C kernels (~7 s) and loads the model, on 2 busy cores
DOCKER_STOP_GRACE = 10  # `docker stop` without -t
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server() -> Iterator[Container]:
    # The image's HEALTHCHECK command, checked every second instead of every 30 s so the test need not wait.
    container = start_container(built_image(), docker_args=("--health-interval", "1s"))
    try:
        container.wait_ready(STARTUP_SECONDS)
        yield container
    finally:
        container.remove()


def test_the_image_answers_chat(server: Container) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]


def test_the_native_cpu_kernels_compiled_in_the_container(server: Container) -> None:
    """The torch fallback only logs a warning: the image must carry what the kernels compile from (sources,
    headers, a C compiler) and a writable cache for them."""
    logs = server.logs()
    assert "native CPU kernels unavailable" not in logs, logs[-3000:]
    assert "native CPU kernels ready" in logs, logs[-3000:]


def test_the_baked_model_is_served_without_converting_it(server: Container) -> None:
    assert "converting" not in server.logs()


def test_it_runs_as_a_non_root_user(server: Container) -> None:
    assert docker("inspect", "-f", "{{.Config.User}}", server.id).stdout.strip() == "10001:10001"
    status = docker("exec", server.id, "cat", "/proc/1/status").stdout  # the server, as the kernel sees it
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert set(uids) == {"10001"}, status


def test_the_healthcheck_turns_healthy(server: Container) -> None:
    deadline = time.monotonic() + 60
    while (health := server.state("Health.Status")) != "healthy" and time.monotonic() < deadline:
        assert health in ("starting", "healthy"), docker("inspect", "-f", "{{json .State.Health}}", server.id).stdout
        time.sleep(0.5)
    assert health == "healthy", docker("inspect", "-f", "{{json .State.Health}}", server.id).stdout


class Stream(threading.Thread):
    """One streaming completion read to its end; `started` is set at its first event (or its failure)."""

    def __init__(self, url: str, index: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = {"model": MODEL, "prompt": f"{index}, {index + 1},", "max_tokens": max_tokens,
                     "ignore_eos": True, "stream": True}  # fmt: skip
        self.started = threading.Event()
        self.events: list[str] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=60) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.started.set()
        except BaseException as exc:  # reported by the test
            self.failure = exc
        finally:
            self.started.set()


def test_docker_stop_with_its_defaults_ends_every_stream_and_exits_0(server: Container) -> None:
    """Last in this file: it stops the container. 300-token streams outlast the image's 3 s drain, so they
    end with an error event, before Docker's 10 s are up; the process exits 0, not 137 (killed)."""
    streams = [Stream(server.url, i, max_tokens=300) for i in range(4)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(60) and stream.failure is None, stream.failure
    started = time.monotonic()
    docker("stop", server.id, timeout=DOCKER_STOP_GRACE + 30)
    took = time.monotonic() - started
    for stream in streams:
        stream.join(30)
        assert not stream.is_alive() and stream.failure is None, stream.failure
        last = stream.events[-1]
        if last != "[DONE]":  # cut at the drain's end: an error event, the documented end of an aborted stream
            assert json.loads(last)["error"]["code"] == "engine_unavailable", last
    exit_code = server.state("ExitCode")
    print(f"\ndocker stop: {took:.1f} s, exit {exit_code}, chunks per stream {[len(s.events) for s in streams]}")
    assert exit_code == "0", f"exit {exit_code} after {took:.1f} s:\n{server.logs()[-3000:]}"
    assert took < DOCKER_STOP_GRACE
    assert "shutting down:" in server.logs()
