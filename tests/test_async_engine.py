"""AsyncEngine: the engine thread, deltas into asyncio, aborts on cancel, errors before the first delta."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from pagedserve.engine import ContextLengthError, EngineConfig, LLMEngine, SamplingParams, SequenceDelta
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.client.async_stream import EngineUnavailableError
from pagedserve.engine.validation import QueueFullError
from pagedserve.engine.worker.model_loader import LoadedModel

CONFIG = EngineConfig(num_kv_blocks=64, max_num_seqs=16, max_logprobs=5)
PROMPT = "The capital of France is"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def make_engine(smol_loaded: LoadedModel) -> Iterator[Callable[..., AsyncEngine]]:
    started: list[AsyncEngine] = []

    def make(llm: LLMEngine | None = None) -> AsyncEngine:
        llm = llm or LLMEngine(CONFIG, smol_loaded)
        engine = AsyncEngine.in_thread(lambda: llm).start()
        started.append(engine)
        assert engine.wait_ready(30)
        return engine

    yield make
    for engine in started:
        engine.shutdown()


async def _drain(engine: AsyncEngine, request_id: str, params: SamplingParams = GREEDY) -> list[SequenceDelta]:
    return [delta async for delta in await engine.generate(request_id, PROMPT, params)]


def _wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    """Until the engine has forgotten every request and published a snapshot saying so."""
    deadline = time.monotonic() + timeout
    while engine.snapshot().num_unfinished or engine.snapshot().num_running or engine.snapshot().num_waiting:
        assert time.monotonic() < deadline, f"engine still busy: {engine.snapshot()}"
        time.sleep(0.01)


def test_concurrent_requests_all_finish_and_free_their_blocks(make_engine: Callable[..., AsyncEngine]) -> None:
    engine = make_engine()

    async def run() -> list[list[SequenceDelta]]:
        return await asyncio.gather(*(_drain(engine, f"r{i}") for i in range(12)))

    results = asyncio.run(run())
    texts = {"".join(d.new_text for d in deltas) for deltas in results}
    assert len(texts) == 1, "the same greedy prompt must give the same text, batched or not"
    for deltas in results:
        assert sum(len(d.new_token_ids) for d in deltas) == 8
        assert [d.finish_reason for d in deltas][-1] == "length"
    _wait_idle(engine)
    assert engine.snapshot().kv_cache_usage == 0.0


def test_cancelling_the_consumer_aborts_the_request(make_engine: Callable[..., AsyncEngine]) -> None:
    engine = make_engine()
    long_run = SamplingParams(max_tokens=500, ignore_eos=True)

    async def run() -> None:
        first_token = asyncio.Event()

        async def consume() -> None:
            async for _ in await engine.generate("long", PROMPT, long_run):
                first_token.set()

        task = asyncio.create_task(consume())
        await first_token.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    _wait_idle(engine)
    assert engine.snapshot().kv_cache_usage == 0.0


def test_closing_the_stream_early_aborts_every_sequence(make_engine: Callable[..., AsyncEngine]) -> None:
    engine = make_engine()

    async def run() -> None:
        stream = await engine.generate("n3", PROMPT, SamplingParams(n=3, max_tokens=500, ignore_eos=True))
        await anext(stream)
        await stream.aclose()

    asyncio.run(run())
    _wait_idle(engine)
    assert engine.snapshot().kv_cache_usage == 0.0


def test_bad_requests_raise_before_any_delta(make_engine: Callable[..., AsyncEngine]) -> None:
    engine = make_engine()
    too_long = list(range(10, 10 + engine.limits.max_model_len))

    async def run() -> None:
        with pytest.raises(ContextLengthError):
            await engine.generate("long", too_long, GREEDY)
        with pytest.raises(ValueError, match="logprobs must be <= 5"):
            await engine.generate("lp", PROMPT, SamplingParams(logprobs=10))
        assert len(await _drain(engine, "fine")) == 8  # the engine carries on

    asyncio.run(run())


def test_a_burst_at_an_idle_engine_fills_the_free_seats_and_the_queue(smol_loaded: LoadedModel) -> None:
    """Requests that free running seats will take at the next step are no backlog: with 2 seats and a queue of
    3, an idle engine accepts 5 at once; a 6th is refused."""
    config = CONFIG.replace(max_num_seqs=2, max_queue_len=3)
    engine = AsyncEngine.in_thread(lambda: LLMEngine(config, smol_loaded)).start()
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    try:
        assert engine.wait_ready(30)

        async def run() -> None:
            streams = [await engine.generate(f"r{i}", PROMPT, long) for i in range(5)]
            with pytest.raises(QueueFullError):  # before a step (5 of 5 places) or after it (2 seated, 3 of 3)
                await engine.generate("sixth", PROMPT, long)
            for stream in streams:
                await stream.aclose()

        asyncio.run(run())
        _wait_idle(engine)
    finally:
        engine.shutdown()


def test_engine_thread_death_fails_pending_requests(
    make_engine: Callable[..., AsyncEngine], smol_loaded: LoadedModel
) -> None:
    llm = LLMEngine(CONFIG, smol_loaded)
    real_step = llm.step
    steps = 0

    def step_then_die() -> list[SequenceDelta]:
        nonlocal steps
        steps += 1
        if steps > 2:
            raise SystemError("scheduler corrupted")
        return real_step()

    llm.step = step_then_die  # type: ignore[method-assign]
    engine = make_engine(llm)

    async def run() -> None:
        with pytest.raises(EngineUnavailableError, match="scheduler corrupted"):
            await _drain(engine, "doomed", SamplingParams(max_tokens=50, ignore_eos=True))
        with pytest.raises(EngineUnavailableError):
            await engine.generate("after", PROMPT, GREEDY)

    asyncio.run(run())
    assert not engine.is_healthy and not engine.is_ready


def test_not_ready_while_loading(smol_loaded: LoadedModel) -> None:
    loaded = threading.Event()

    def slow_load() -> LLMEngine:
        loaded.wait(30)
        return LLMEngine(CONFIG, smol_loaded)

    engine = AsyncEngine.in_thread(slow_load).start()
    try:
        assert not engine.is_ready and engine.is_healthy
        with pytest.raises(EngineUnavailableError, match="loading"):
            asyncio.run(_drain(engine, "early"))
        loaded.set()
        assert engine.wait_ready(30)
    finally:
        engine.shutdown()


def test_shutdown_aborts_requests_in_flight(make_engine: Callable[..., AsyncEngine]) -> None:
    engine = make_engine()

    async def run() -> list[SequenceDelta]:
        stream = await engine.generate("cut", PROMPT, SamplingParams(max_tokens=500, ignore_eos=True))
        deltas = [await anext(stream)]
        await asyncio.to_thread(engine.shutdown)
        return deltas + [delta async for delta in stream]

    deltas = asyncio.run(run())
    assert deltas[-1].finish_reason == "abort"
    assert not engine.is_ready
