"""How fast the processes end once told to: the engine core within a second of Shutdown, and an idle
`pagedserve serve` within seconds of SIGTERM, so that a container's stop grace (Docker's 10 s) goes to the
drain. Both used to spend seconds in the interpreter's teardown (freeing torch's and transformers' objects one
by one) after their work was done."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from pagedserve.engine import EngineConfig, SamplingParams, StructuredOutput
from pagedserve.engine.client.async_engine import AsyncEngine
from tests.servers import free_port, server_process

STARTUP_SECONDS = 180  # loading on a busy 2-core machine
CORE_EXIT_SECONDS = 1.0
SERVER_EXIT_SECONDS = 3.0  # uvicorn's own shutdown, the core's exit and the process's


def gone(process: psutil.Process) -> bool:
    return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE


def test_the_core_process_exits_within_a_second_of_being_told_to(smol_dir: Path) -> None:
    """After a constrained request, so that the core has grammar sandbox children to end as well."""
    engine = AsyncEngine.from_config(EngineConfig(model=str(smol_dir), num_kv_blocks=64, num_threads=1)).start()
    try:
        assert engine.wait_ready(STARTUP_SECONDS), engine.unavailable_reason()

        async def constrained() -> None:
            params = SamplingParams(max_tokens=4, structured_output=StructuredOutput("choice", '["yes", "no"]'))
            async for _ in await engine.generate("c", [5, 6, 7], params):
                pass

        asyncio.run(constrained())
        core = psutil.Process(engine.info.pid)
        family = [core, *core.children(recursive=True)]
        started = time.monotonic()
    finally:
        engine.shutdown()
    took = time.monotonic() - started
    assert all(gone(process) for process in family), [p for p in family if not gone(p)]
    assert took < CORE_EXIT_SECONDS, f"the core took {took:.2f} s to exit"


def test_an_idle_server_exits_within_seconds_of_sigterm(tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "pagedserve.server.cli", "serve", "--port", str(port),
               "--num-kv-blocks", "64", "--num-threads", "1"]  # fmt: skip
    with server_process(command, f"http://127.0.0.1:{port}", tmp_path / "serve.log", STARTUP_SECONDS) as server:
        family = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - started
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert all(gone(process) for process in family)
    assert took < SERVER_EXIT_SECONDS, f"the server took {took:.2f} s to exit"
