"""Graceful shutdown of the real `pagedserve serve` process: SIGTERM drains streams, or aborts them at the timeout.

Two servers start at once (each loads the embedded model from the converted cache, ~5-10 s): one drains with
the default 30 s timeout, one has a 1 s timeout that its streams outlast.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.servers import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
NUM_STREAMS = 8
STARTUP_SECONDS = 180  # loading on a busy 2-core machine


@dataclass
class Served:
    process: subprocess.Popen
    url: str
    log: Path

    def lines(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]  # every line must be JSON


def launch(folder: Path, shutdown_timeout: str) -> Served:
    port = free_port()
    log = folder / f"serve-{shutdown_timeout}s.log"
    command = [
        sys.executable, "-m", "pagedserve.server.cli", "serve",
        "--port", str(port), "--shutdown-timeout", shutdown_timeout,
        "--log-format", "json", "--num-kv-blocks", "256", "--max-num-seqs", str(NUM_STREAMS),
        "--num-threads", "1",  # two idle-spinning torch threads crawl on a 2-core machine that is busy elsewhere
    ]  # fmt: skip
    with log.open("w") as sink:
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    return Served(process, f"http://127.0.0.1:{port}", log)


def wait_until_ready(served: Served, deadline: float) -> None:
    if not wait_ready(served.process, served.url, deadline - time.monotonic()):
        pytest.fail(f"the server did not become ready:\n{served.log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    folder = tmp_path_factory.mktemp("drain")
    started = {"drain": launch(folder, "30"), "abort": launch(folder, "1")}
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        for served in started.values():
            wait_until_ready(served, deadline)
        yield started
    finally:
        for served in started.values():
            if served.process.poll() is None:
                served.process.kill()
                served.process.wait()


class StreamReader(threading.Thread):
    """Reads one streaming completion to its end; `first_token` is set once a token (or a failure) came."""

    def __init__(self, url: str, index: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.body = {"model": "SmolLM2-135M-Instruct", "prompt": f"{index}, {index + 1},", "max_tokens": max_tokens,
                     "ignore_eos": True, "stream": True}  # fmt: skip
        self.url = url
        self.first_token = threading.Event()
        self.data: list[str] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.data.append(line.removeprefix("data: "))
                        self.first_token.set()
        except BaseException as exc:  # reported by the test
            self.failure = exc
        finally:
            self.first_token.set()


def start_streams(served: Served, max_tokens: int) -> list[StreamReader]:
    readers = [StreamReader(served.url, i, max_tokens) for i in range(NUM_STREAMS)]
    for reader in readers:
        reader.start()
    for reader in readers:
        assert reader.first_token.wait(120) and reader.failure is None, reader.failure
    return readers


def finish(readers: list[StreamReader], timeout: float) -> None:
    for reader in readers:
        reader.join(timeout)
        assert not reader.is_alive(), "a stream outlived the shutdown"
        assert reader.failure is None, reader.failure


def test_sigterm_lets_streams_finish_refuses_new_requests_and_exits_0(servers: dict[str, Served]) -> None:
    served = servers["drain"]
    readers = start_streams(served, max_tokens=16)
    served.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 2
    while httpx.get(f"{served.url}/ready").status_code != 503:
        assert time.monotonic() < deadline, "/ready did not turn 503"
        time.sleep(0.01)
    refused = httpx.post(f"{served.url}/v1/completions", json={**readers[0].body, "stream": False})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
    finish(readers, timeout=60)
    for reader in readers:
        assert reader.data[-1] == "[DONE]"
        assert json.loads(reader.data[-2])["choices"][0]["finish_reason"] == "length"
    assert served.process.wait(60) == 0
    lines = served.lines()
    drained = [line for line in lines if line.get("message", "").startswith("shutting down")]
    assert drained and f"{NUM_STREAMS} requests in flight" in drained[0]["message"], drained
    finished = [line for line in lines if line["logger"] == "pagedserve.requests" and line["status"] == 200]
    assert [line["finish_reasons"] for line in finished] == [["length"]] * NUM_STREAMS
    assert any(line["logger"] == "uvicorn.access" and line["status"] == 503 for line in lines)


def test_streams_past_the_shutdown_timeout_end_with_an_error_event(servers: dict[str, Served]) -> None:
    served = servers["abort"]
    readers = start_streams(served, max_tokens=400)
    served.process.send_signal(signal.SIGTERM)
    finish(readers, timeout=30)
    for reader in readers:
        assert "[DONE]" not in reader.data
        assert json.loads(reader.data[-1])["error"]["code"] == "engine_unavailable"
    assert served.process.wait(30) == 0
