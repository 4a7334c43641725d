"""The CPU image, built from this checkout and run for real, three ways: with the image's own CMD, with
`--host 0.0.0.0 --port 8521` after the image name, and with `--read-only --tmpfs /home/pagedserve`. Each
answers, runs the native kernels it ships (the runtime has no compiler) as a non-root user and turns healthy
where it really listens; `docker stop` with Docker's defaults ends every stream cleanly and exits 0 inside the
10 s grace, whatever the arguments; an idle one stops in seconds (the engine core exits at once).

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

STARTUP_SECONDS = 180  # a fresh container loads the model on 2 busy cores
DOCKER_STOP_GRACE = 10  # `docker stop` without -t
IDLE_STOP_SECONDS = 4  # uvicorn's shutdown, the engine core's exit and the server's, on a busy machine
MODEL = "SmolLM2-135M-Instruct"
OTHER_PORT = 8521
PREBUILT_KERNELS = "/opt/pagedserve/cpu-kernels/"
# The image's HEALTHCHECK command, checked every second instead of every 30 s so the tests need not wait.
FAST_HEALTH = ("--health-interval", "1s")


def started(*args: str, docker_args: tuple[str, ...] = FAST_HEALTH, container_port: int = 8000) -> Iterator[Container]:
    container = start_container(built_image(), *args, docker_args=docker_args, container_port=container_port)
    try:
        container.wait_ready(STARTUP_SECONDS)
        yield container
    finally:
        container.remove()


@pytest.fixture(scope="module")
def server() -> Iterator[Container]:
    yield from started()


@pytest.fixture(scope="module")
def server_with_arguments() -> Iterator[Container]:
    """Arguments after the image name replace CMD: the image's port, host and drain must not live there."""
    yield from started("--host", "0.0.0.0", "--port", str(OTHER_PORT), container_port=OTHER_PORT)


@pytest.fixture(scope="module")
def read_only_server() -> Iterator[Container]:
    """A read-only root and a home on tmpfs, which Docker mounts noexec: no library can be built or loaded
    there, so the native kernels must come from the image."""
    yield from started(docker_args=(*FAST_HEALTH, "--read-only", "--tmpfs", "/home/pagedserve"))


def answers_chat(container: Container) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    answer = httpx.post(f"{container.url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


def test_the_build_leaves_no_untagged_images() -> None:
    built_image()
    leftovers = docker(
        "images", "-q", "--filter", "dangling=true", "--filter", "label=org.opencontainers.image.title=pagedserve"
    ).stdout.split()
    assert not leftovers, f"untagged images left by the build: {leftovers}"


def test_the_image_answers_chat(server: Container) -> None:
    assert answers_chat(server)


def test_the_native_cpu_kernels_come_built_with_the_image(server: Container) -> None:
    """The runtime has no compiler: the kernels are the image's, built ahead of time for the best CPU level."""
    logs = server.logs()
    assert "native CPU kernels unavailable" not in logs, logs[-3000:]
    assert f"native CPU kernels ready ({PREBUILT_KERNELS}" in logs, logs[-3000:]
    assert "compiled the CPU kernels" not in logs
    # No layer of the image installs a compiler (a base image may carry one: the sandbox's stand-in for
    # python:3.11-slim has build-essential, which Debian's python3-pip recommends).
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", built_image()).stdout.splitlines()
    first_own = max(i for i, step in enumerate(history) if "org.opencontainers.image.title" in step)  # newest first
    own = "\n".join(history[: first_own + 1])
    assert "apt-get install" not in own and "gcc" not in own, own


def test_the_baked_model_is_served_without_converting_it(server: Container) -> None:
    assert "converting" not in server.logs()


def test_it_runs_as_a_non_root_user(server: Container) -> None:
    assert docker("inspect", "-f", "{{.Config.User}}", server.id).stdout.strip() == "10001:10001"
    status = docker("exec", server.id, "cat", "/proc/1/status").stdout  # the server, as the kernel sees it
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert set(uids) == {"10001"}, status


def wait_healthy(container: Container) -> None:
    deadline = time.monotonic() + 60
    while (health := container.state("Health.Status")) != "healthy" and time.monotonic() < deadline:
        detail = docker("inspect", "-f", "{{json .State.Health}}", container.id).stdout
        assert health in ("starting", "healthy"), detail
        time.sleep(0.5)
    assert health == "healthy", docker("inspect", "-f", "{{json .State.Health}}", container.id).stdout


def test_the_healthcheck_turns_healthy(server: Container) -> None:
    wait_healthy(server)


def test_the_healthcheck_probes_the_port_given_after_the_image_name(server_with_arguments: Container) -> None:
    """The image's PAGEDSERVE_PORT=8000 is still in the environment: the check must read --port as the server
    did, not the variable alone."""
    wait_healthy(server_with_arguments)
    assert answers_chat(server_with_arguments)


def test_a_read_only_container_serves_on_the_shipped_kernels(read_only_server: Container) -> None:
    assert answers_chat(read_only_server)
    logs = read_only_server.logs()
    assert f"native CPU kernels ready ({PREBUILT_KERNELS}" in logs, logs[-3000:]
    assert "native CPU kernels unavailable" not in logs
    wait_healthy(read_only_server)


def test_an_idle_container_stops_in_seconds(read_only_server: Container) -> None:
    """Nothing to drain: the time is uvicorn's shutdown and the processes' exits (the engine core alone took
    ~5 s before it skipped the interpreter's teardown)."""
    took, exit_code = stop(read_only_server)
    print(f"\ndocker stop of an idle container: {took:.1f} s, exit {exit_code}")
    assert exit_code == "0", read_only_server.logs()[-3000:]
    assert took < IDLE_STOP_SECONDS, f"docker stop took {took:.1f} s:\n{read_only_server.logs()[-2000:]}"


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


def stop(container: Container) -> tuple[float, str]:
    """`docker stop` with Docker's default grace: (seconds it took, the exit code)."""
    started_at = time.monotonic()
    docker("stop", container.id, timeout=DOCKER_STOP_GRACE + 30)
    return time.monotonic() - started_at, container.state("ExitCode")


@pytest.mark.parametrize("fixture", ["server", "server_with_arguments"], ids=["image-cmd", "host-port-arguments"])
def test_docker_stop_with_its_defaults_ends_every_stream_and_exits_0(fixture: str, request) -> None:
    """Last for its container: it stops it. 300-token streams outlast the image's 3 s drain, so they end with an
    error event, before Docker's 10 s are up; the process exits 0, not 137 (killed). With arguments after the
    image name the drain used to be the CLI's 30 s, and every stop ended in SIGKILL."""
    container: Container = request.getfixturevalue(fixture)
    streams = [Stream(container.url, i, max_tokens=300) for i in range(4)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(60) and stream.failure is None, stream.failure
    took, exit_code = stop(container)
    for stream in streams:
        stream.join(30)
        assert not stream.is_alive() and stream.failure is None, stream.failure
        last = stream.events[-1]
        if last != "[DONE]":  # cut at the drain's end: an error event, the documented end of an aborted stream
            assert json.loads(last)["error"]["code"] == "engine_unavailable", last
    print(f"\ndocker stop: {took:.1f} s, exit {exit_code}, chunks per stream {[len(s.events) for s in streams]}")
    assert exit_code == "0", f"exit {exit_code} after {took:.1f} s:\n{container.logs()[-3000:]}"
    assert took < DOCKER_STOP_GRACE
    assert "shutting down:" in container.logs()
