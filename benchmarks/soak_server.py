"""The soak's server: `pagedserve serve` in a process of its own, and what the soak reads from it over HTTP.

The server runs apart from the soak's clients so that neither's work (the server's formatting of a large answer,
the clients' parsing of it) holds the other's interpreter: a gap an innocent stream sees is the server's.
What the soak checks once the traffic stops, it reads from /metrics as an operator would.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from tests.servers import free_port, server_process

STARTUP_SECONDS = 300.0  # a busy shared machine loads the model slowly
GAUGES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "num_kv_blocks",
    "num_free_kv_blocks",
    "num_queue_places_held",
)


@dataclass(frozen=True)
class Served:
    url: str
    pid: int  # the API process; the engine core is its child

    def processes(self) -> list[psutil.Process]:
        """The API process and its children (the engine core, grammar-compiling sandboxes while they run)."""
        server = psutil.Process(self.pid)
        return [server, *server.children(recursive=True)]

    def services(self) -> list[psutil.Process]:
        """The processes that live as long as the server: the API process and the engine core."""
        return [process for process in self.processes() if not _is_sandbox(process)]

    def sandboxes(self) -> list[psutil.Process]:
        """The grammar sandboxes' children alive now (a pool of a few a process that compiles grammars, each started
        at its first grammar: engine/structured/sandbox.py)."""
        return [process for process in self.processes() if _is_sandbox(process)]

    def gauges(self) -> dict[str, float]:
        """The engine's gauges from /metrics (one model: one sample each)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            name, _, rest = line.partition("{")
            short = name.removeprefix("pagedserve:")
            if short in GAUGES and name != short:
                values[short] = float(rest.rsplit(" ", 1)[1])
        return values


@contextlib.contextmanager
def serve_process(engine_flags: list[str], model_name: str, api_key: str, log: Path) -> Iterator[Served]:
    """`pagedserve serve` on 127.0.0.1 (a free port the OS chose) with `engine_flags`, logging to `log`."""
    port = free_port()
    command = [
        sys.executable, "-m", "pagedserve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", model_name, *engine_flags,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    # The key goes by the environment, not the command line, where any process list would show it.
    with server_process(command, url, log, STARTUP_SECONDS, env={"PAGEDSERVE_API_KEY": api_key}) as process:
        yield Served(url, process.pid)


def wait_idle(served: Served, timeout: float) -> dict[str, float]:
    """The gauges once no sequence runs or waits (or at `timeout`)."""
    deadline = time.monotonic() + timeout
    gauges = served.gauges()
    while gauges["num_requests_running"] + gauges["num_requests_waiting"] and time.monotonic() < deadline:
        time.sleep(0.2)
        gauges = served.gauges()
    time.sleep(0.1)  # the core publishes its snapshot after the last delta
    return served.gauges()


def places_held(served: Served, settle: float) -> int:
    """Queue places still held with nothing left to run. A place comes back just after its answer is sent (and a
    body timeout's 408 may still be due): polled until none is held, for up to `settle` seconds."""
    deadline = time.monotonic() + settle
    while (held := served.gauges()["num_queue_places_held"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return int(held)


def _is_sandbox(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        return any(part.endswith("sandbox_child.py") for part in process.cmdline())
    return False
