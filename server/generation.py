"""What chat and completions share: starting engine requests, merging their streams, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from starlette.requests import Request

from pagedserve.engine import CompletionOutput, QueueFullError, SamplingParams, SequenceDelta
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.client.async_stream import EngineUnavailableError, RequestStream, Reservation
from pagedserve.server.errors import ClientDisconnected, server_error, to_api_error
from pagedserve.server.logs import RequestRecord

T = TypeVar("T")
Streams = list[RequestStream]
RESERVATION = "queue_reservation"  # request.state's: the queue place LoadSheddingMiddleware reserved


def reserved_place(request: Request) -> Reservation | None:
    return getattr(request.state, RESERVATION, None)


async def start_streams(
    engine: AsyncEngine,
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    prompt_param: str,
    queue_timeout: float | None,
    reservation: Reservation | None = None,
) -> Streams:
    """One engine request per prompt, all or none: a refused prompt aborts those already started. The first
    takes the request's reserved queue place, if it holds one."""
    streams: Streams = []
    try:
        for index, prompt in enumerate(prompts):
            engine_id = request_id if len(prompts) == 1 else f"{request_id}/{index}"
            held = reservation if index == 0 else None
            streams.append(await engine.generate(engine_id, prompt, params, queue_timeout, held))
    except (ValueError, QueueFullError, EngineUnavailableError) as exc:
        close_all(streams)
        raise to_api_error(exc, prompt_param) from exc
    except BaseException:
        close_all(streams)
        raise
    return streams


def close_all(streams: Streams) -> None:
    """Aborts whatever has not finished (a no-op for finished streams)."""
    for stream in streams:
        stream.close()


async def merged(streams: Streams) -> AsyncGenerator[tuple[int, SequenceDelta], None]:
    """(prompt index, delta) from all streams as they come. Closing it aborts the unfinished streams."""
    tasks: list[asyncio.Task] = []
    try:
        if len(streams) == 1:  # the common case, without a hop through a queue
            async for delta in streams[0]:
                yield 0, delta
            return
        queue: asyncio.Queue[tuple[int, SequenceDelta | Exception | None]] = asyncio.Queue()
        tasks = [asyncio.create_task(_pump(i, stream, queue)) for i, stream in enumerate(streams)]
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        close_all(streams)


async def _pump(index: int, stream: RequestStream, queue: asyncio.Queue) -> None:
    try:
        async for delta in stream:
            queue.put_nowait((index, delta))
        queue.put_nowait((index, None))
    except Exception as exc:  # handed to the consumer, which decides
        queue.put_nowait((index, exc))


def raise_if_failed(delta: SequenceDelta) -> None:
    if delta.finish_reason == "error":
        message = f"generation failed: {delta.error or 'unknown engine error'}"
        raise server_error(500, message, "engine_error")


async def recorded(streams: Streams, record: RequestRecord) -> AsyncGenerator[tuple[int, SequenceDelta], None]:
    """merged(streams), each delta counted in the request's record; an engine error raises (raise_if_failed).
    Close it (contextlib.aclosing) to abort the unfinished streams."""
    async with contextlib.aclosing(merged(streams)) as deltas:
        async for prompt_index, delta in deltas:
            raise_if_failed(delta)
            record.add(prompt_index, delta)
            yield prompt_index, delta


async def collect(streams: Streams, n: int, record: RequestRecord) -> list[CompletionOutput]:
    """Whole outputs, indexed prompt-major like OpenAI (choice index = prompt index * n + sample)."""
    outputs = [CompletionOutput(index=i) for i in range(len(streams) * n)]
    async with contextlib.aclosing(recorded(streams, record)) as deltas:
        async for prompt_index, delta in deltas:
            outputs[prompt_index * n + delta.index].extend(delta)
    return outputs


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it (which aborts its engine requests) if the client hangs up first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientDisconnected
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
