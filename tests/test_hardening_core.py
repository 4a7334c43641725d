"""A wedged engine core: liveness notices within seconds and deadlines fire on the API process's own clock.

The core is stopped (SIGSTOP) behind a real server: /health and /ready turn 503 once its heartbeat has been
silent for engine_heartbeat_timeout, a request past its --request-timeout gets 504 on time, new requests are
refused at once, and everything recovers when the core resumes. A fake core that never sends a step shows the
same without a model: deadlines fire with no message from the core at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import transformers

from pagedserve.engine import EngineConfig, SamplingParams
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.client.async_stream import QueueTimeoutError, RequestTimeoutError
from pagedserve.engine.core.messages import (
    AbortRequests,
    Command,
    CoreMessage,
    EngineInfo,
    EngineSnapshot,
    Heartbeat,
    Ready,
    StepOutput,
)
from pagedserve.engine.core.process import CoreConnection, CoreGone
from pagedserve.engine.text.text_tokenizer import TokenizerSpec
from pagedserve.engine.validation import RequestLimits
from pagedserve.server import ServerSettings
from tests.servers import serving

STARTUP_SECONDS = 180  # loading on a busy 2-core machine
REQUEST_TIMEOUT = 3.0
BODY = {"model": "m", "prompt": "Once upon a time", "max_tokens": 4}


def _wait_status(url: str, status: int, within: float) -> tuple[float, httpx.Response]:
    """Polls `url` until it answers `status` (or `within` seconds pass); how long that took, and the answer."""
    start = time.monotonic()
    while True:
        answer = httpx.get(url, timeout=5)
        elapsed = time.monotonic() - start
        if answer.status_code == status or elapsed > within:
            return elapsed, answer
        time.sleep(0.2)


@contextlib.contextmanager
def _stopped(process: psutil.Process) -> Iterator[None]:
    """SIGSTOP for the block; SIGCONT however it ends, so no stopped process outlives a failed test."""
    process.suspend()
    try:
        yield
    finally:
        process.resume()


def _timed_post(url: str, answers: list[tuple[float, httpx.Response]]) -> None:
    start = time.monotonic()
    answer = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
    answers.append((time.monotonic() - start, answer))


@pytest.mark.slow
def test_a_stopped_core_turns_health_503_times_requests_out_and_recovers(smol_dir: Path) -> None:
    config = EngineConfig(model=str(smol_dir), num_kv_blocks=64, num_threads=1, request_timeout=REQUEST_TIMEOUT)
    engine = AsyncEngine.from_config(config).start()
    try:
        assert engine.wait_ready(STARTUP_SECONDS), engine.unavailable_reason()
        core = psutil.Process(engine.info.pid)
        with serving(engine, ServerSettings(["m"])) as url:
            assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).status_code == 200
            answers: list[tuple[float, httpx.Response]] = []
            with _stopped(core):
                request = threading.Thread(target=_timed_post, args=(url, answers))
                request.start()
                # A send to a core that reads nothing must not wait on it (it would stall the event loop).
                big_abort = threading.Thread(target=engine.abort, args=("x" * (8 << 20),), daemon=True)
                big_abort.start()
                big_abort.join(5)
                assert not big_abort.is_alive(), "a send waited on the stopped core"

                noticed, health = _wait_status(f"{url}/health", 503, within=15)
                assert health.status_code == 503, f"/health still {health.status_code} after {noticed:.1f} s"
                assert "not answered" in health.json()["reason"]
                assert httpx.get(f"{url}/ready").status_code == 503

                request.join(30)
                ((took, answer),) = answers
                assert answer.status_code == 504 and answer.json()["error"]["code"] == "request_timeout"
                assert REQUEST_TIMEOUT - 0.5 <= took <= REQUEST_TIMEOUT + 5, f"504 after {took:.1f} s"

                start = time.monotonic()
                refused = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
                assert time.monotonic() - start < 3, "a request to a wedged core must be refused at once"

            recovered, health = _wait_status(f"{url}/health", 200, within=15)
            assert health.status_code == 200, f"/health still {health.status_code} {recovered:.1f} s after SIGCONT"
            assert httpx.get(f"{url}/ready").status_code == 200
            assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).status_code == 200
    finally:
        engine.shutdown()


# ---- without a model: a core that loads, then says nothing but what the test hands it ------------------------


class SilentCore(CoreConnection):
    """Ready, then only what the test puts in `messages`: no step ever runs."""

    def __init__(self, ready: Ready) -> None:
        self.messages: queue.SimpleQueue[CoreMessage | Heartbeat | None] = queue.SimpleQueue()
        self.messages.put(ready)
        self.sent: list[Command] = []

    def _start(self, heartbeats: bool) -> None:
        pass

    def send(self, command: Command) -> None:
        self.sent.append(command)

    def _next(self) -> CoreMessage | Heartbeat:
        message = self.messages.get()
        if message is None:
            self.messages.put(None)
            raise CoreGone("the silent core ended")
        return message

    def join(self, timeout: float) -> None:
        self.messages.put(None)


def _silent_engine(smol_dir: Path, heartbeat_timeout: float, **limits: float) -> tuple[AsyncEngine, SilentCore]:
    info = EngineInfo(
        model_dir=str(smol_dir),
        tokenizer=TokenizerSpec.of(transformers.AutoTokenizer.from_pretrained(smol_dir)),
        trust_message_special_tokens=False,
        limits=RequestLimits(2048, 49152, 4, 8, 5, 16),
        max_queue_time=limits.get("max_queue_time"),
        request_timeout=limits.get("request_timeout"),
        num_kv_blocks=64,
        block_size=16,
        device="cpu",
        pid=0,
        heartbeat_timeout=heartbeat_timeout,
    )
    core = SilentCore(Ready(info, EngineSnapshot(queue_capacity=16)))
    engine = AsyncEngine(core).start()
    assert engine.wait_ready(60), engine.unavailable_reason()
    return engine, core


async def _failure(engine: AsyncEngine, request_id: str, **kwargs: float) -> tuple[float, BaseException]:
    start = time.monotonic()
    stream = await engine.generate(request_id, [5, 6, 7], SamplingParams(max_tokens=4), **kwargs)
    with pytest.raises(TimeoutError) as raised:
        await asyncio.wait_for(anext(stream), 10)
    return time.monotonic() - start, raised.value


def test_deadlines_fire_though_the_core_sends_nothing(smol_dir: Path) -> None:
    engine, core = _silent_engine(smol_dir, heartbeat_timeout=60, max_queue_time=0.6, request_timeout=1.2)
    try:

        async def run() -> list[tuple[float, BaseException]]:
            return [
                await _failure(engine, "own-wait", queue_timeout=0.3),
                await _failure(engine, "queued"),
            ]

        (own_took, own), (queued_took, queued) = asyncio.run(run())
        assert isinstance(own, QueueTimeoutError) and own.requested and 0.25 <= own_took < 1.5
        assert isinstance(queued, QueueTimeoutError) and not queued.requested and 0.55 <= queued_took < 2
        aborted = [command.request_ids for command in core.sent if isinstance(command, AbortRequests)]
        assert aborted == [["own-wait"], ["queued"]]

        async def admitted_then_late() -> tuple[float, BaseException]:
            start = time.monotonic()
            stream = await engine.generate("late", [5, 6, 7], SamplingParams(max_tokens=4))
            admitted = StepOutput(deltas=[], snapshot=EngineSnapshot(queue_capacity=16), admitted=["late"])
            core.messages.put(admitted)  # scheduled before max_queue_time: only request_timeout is left
            with pytest.raises(TimeoutError) as raised:
                await asyncio.wait_for(anext(stream), 10)
            return time.monotonic() - start, raised.value

        late_took, late = asyncio.run(admitted_then_late())
        assert isinstance(late, RequestTimeoutError) and 1.15 <= late_took < 3
    finally:
        engine.shutdown()


def test_a_silent_core_is_unhealthy_until_it_beats_again(smol_dir: Path) -> None:
    engine, core = _silent_engine(smol_dir, heartbeat_timeout=0.5)
    try:
        assert engine.is_healthy and engine.is_ready
        time.sleep(0.8)
        assert not engine.is_healthy and not engine.is_ready
        assert "not answered" in engine.unavailable_reason()
        core.messages.put(Heartbeat())
        deadline = time.monotonic() + 5
        while not engine.is_healthy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.is_healthy and engine.is_ready
    finally:
        engine.shutdown()
    assert engine.is_healthy, "a core that was shut down is not a wedged one"
