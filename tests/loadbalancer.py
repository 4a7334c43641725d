"""The shipped load balancer (docker/loadbalancer/run-local.sh: haproxy) for tests and benchmarks."""

from __future__ import annotations

import csv
import io
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
RUN_LOCAL = ROOT / "docker" / "loadbalancer" / "run-local.sh"
MODEL = "SmolLM2-135M-Instruct"
# haproxy lives in sbin, which a non-root PATH may lack.
PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])


def find_haproxy() -> str | None:
    return shutil.which("haproxy", path=PATH)


@dataclass
class LoadBalancer:
    process: subprocess.Popen
    port: int
    stats_port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> list[dict[str, str]]:
        """haproxy's statistics, one row per frontend, server and backend (its `show stat` CSV)."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        return list(csv.DictReader(io.StringIO(text.removeprefix("# "))))

    def server_status(self) -> dict[str, str]:
        """{server name: UP, DOWN, MAINT, ...} for the replicas."""
        rows = self.stats()
        proxies = ("FRONTEND", "BACKEND")
        return {r["svname"]: r["status"] for r in rows if r["pxname"] == "pagedserve" and r["svname"] not in proxies}

    def backend(self) -> dict[str, str]:
        """The backend's row: retries (wretr), redispatches (wredis), failed connections (econ), ..."""
        (row,) = [r for r in self.stats() if r["pxname"] == "pagedserve" and r["svname"] == "BACKEND"]
        return row

    def wait_until(self, status: dict[str, str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (now := self.server_status()) != status:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise AssertionError(f"haproxy sees {now}, not {status}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_load_balancer(backends: list[str], log: Path, timeout: float = 10, script: Path = RUN_LOCAL) -> LoadBalancer:
    """run-local.sh (or a copy: `script`) on free ports in front of `backends` (host:port); returns once it
    answers on its stats port."""
    port, stats_port = free_port(), free_port()
    with log.open("w") as sink:
        process = subprocess.Popen(
            [str(script), str(port), *backends],
            env={**os.environ, "PATH": PATH, "STATS_PORT": str(stats_port)},
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    balancer = LoadBalancer(process, port, stats_port, log)
    deadline = time.monotonic() + timeout
    while True:
        try:
            balancer.stats()
            return balancer
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                balancer.stop()
                raise RuntimeError(f"haproxy did not start:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.1)


@dataclass
class Outcome:
    """One streaming completion, as its client saw it."""

    started: float
    head: float | None = None  # when the response's status line and headers came
    status: int | None = None
    first_token: float | None = None
    gaps: list[float] = field(default_factory=list)  # between consecutive events
    events: int = 0
    done: bool = False  # ended with [DONE]
    error: str = ""  # the exception that ended it, if any
    request_id: str = ""


def stream(url: str, index: int, max_tokens: int, headers: dict[str, str] | None = None) -> Outcome:
    """One streaming completion of `max_tokens` tokens, timed event by event; transport errors are recorded."""
    body = {"model": MODEL, "prompt": f"{index}, {index + 1},", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip
    outcome = Outcome(time.monotonic())
    last = 0.0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as response:
            outcome.head, outcome.status = time.monotonic(), response.status_code
            outcome.request_id = response.headers.get("x-request-id", "")
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.monotonic()
                if outcome.events:
                    outcome.gaps.append(now - last)
                else:
                    outcome.first_token = now
                last = now
                outcome.events += 1
                outcome.done = line == "data: [DONE]"
    except httpx.HTTPError as exc:
        outcome.error = type(exc).__name__
    return outcome
