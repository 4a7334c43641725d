"""The engine core in a process of its own: same tokens as on a thread, and either side dying ends the other.

Each test starts real processes (the core loads the embedded model from the converted cache, seconds).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pagedserve.engine import LLM, EngineConfig, SamplingParams
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.server import ServerSettings, create_app
from tests.background import BackgroundServer
from tests.servers import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [100, 200, 300]]
STARTUP_SECONDS = 180  # loading on a busy 2-core machine


def wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_offline_llm_in_a_process_matches_the_thread_and_leaves_nothing(tiny_model_dir) -> None:
    model = str(tiny_model_dir("llama"))
    with LLM(model=model, num_kv_blocks=32, engine_process=False) as on_thread:
        expected = [o.outputs[0].token_ids for o in on_thread.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(model=model, num_kv_blocks=32)
    core_pid = llm.info.pid
    assert core_pid != os.getpid()
    core = psutil.Process(core_pid)
    assert core.environ().get("OMP_WAIT_POLICY") == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    assert core.nice() == min(19, psutil.Process().nice() + EngineConfig().engine_niceness)  # the caller goes first
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert llm.stats().generation_tokens == 2 * GREEDY.max_tokens
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]], GREEDY)  # checked before anything runs: the core never sees it
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)] == expected[:1]
    llm.close()
    assert wait_gone(core_pid)


def test_a_dead_core_turns_health_503_and_fails_requests(smol_dir: Path) -> None:
    engine = AsyncEngine.from_config(EngineConfig(model=str(smol_dir), num_kv_blocks=64, num_threads=1)).start()
    died: list[bool] = []
    engine.on_death(lambda: died.append(True))
    try:
        assert engine.wait_ready(STARTUP_SECONDS), engine.unavailable_reason()
        core = psutil.Process(engine.info.pid)
        assert core.pid != os.getpid()
        with BackgroundServer(create_app(engine, ServerSettings(["m"]))) as server:
            assert httpx.get(f"{server.url}/health").status_code == 200

            async def stream_then_kill() -> None:
                params = SamplingParams(max_tokens=1000, ignore_eos=True)
                stream = await engine.generate("doomed", [5, 6, 7], params)
                await anext(stream)
                core.send_signal(signal.SIGKILL)
                with pytest.raises(Exception, match="engine core process ended"):
                    async for _ in stream:
                        pass

            asyncio.run(stream_then_kill())
            health = httpx.get(f"{server.url}/health")
            assert health.status_code == 503
            assert "SIGKILL" in health.json()["reason"]
            answer = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "hi"})
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_unavailable"
        assert died == [True] and not engine.is_healthy
    finally:
        engine.shutdown()


def _serve(*flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "pagedserve.server.cli", "serve", "--port", str(port), *flags]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    if not wait_ready(process, url, STARTUP_SECONDS):
        process.kill()
        raise AssertionError("the server did not become ready")
    return process, url


def _core_of(server: subprocess.Popen) -> psutil.Process:
    (core,) = psutil.Process(server.pid).children()
    return core


@pytest.mark.slow
def test_the_server_exits_1_when_its_core_dies_and_the_core_exits_when_the_server_dies() -> None:
    flags = ("--num-kv-blocks", "64", "--num-threads", "1")
    server, _ = _serve(*flags)
    try:
        core = _core_of(server)
        core.send_signal(signal.SIGKILL)
        assert server.wait(60) == 1  # drained and exited on its own: an orchestrator restarts it
        assert wait_gone(core.pid)
    finally:
        server.kill()

    server, _ = _serve(*flags)
    try:
        core = _core_of(server)
        server.send_signal(signal.SIGKILL)  # no chance to clean up: the core must notice by itself
        server.wait(30)
        assert wait_gone(core.pid), "the engine core outlived its server"
    finally:
        server.kill()
