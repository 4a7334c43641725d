"""What the generation endpoints (chat, completions, responses) share: their handlers' opening, starting
engine requests, merging their streams, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from typing import TypeVar

from starlette.requests import Request

from pagedserve.engine import CompletionOutput, QueueFullError, SamplingParams, SequenceDelta
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.client.async_stream import EngineUnavailableError, RequestStream, Reservation
from pagedserve.server.admission import reserved_place
from pagedserve.server.context import serving
from pagedserve.server.errors import APIError, ClientDisconnected, server_error, to_api_error
from pagedserve.server.request_log import RequestRecord

T = TypeVar("T")
Streams = list[RequestStream]


class Generation:
    """A generation request from its handler's opening: the serving context and its ready engine, for a served
    model; the request's id and log record; ValueErrors as the client's errors; its engine requests started on
    its admitted queue place; the whole answer collected unless the client hangs up.

    `restate` rewrites, in place, the errors it raises, for an endpoint that names a field differently.
    """

    def __init__(self, request: Request, model: str, restate: Callable[[APIError], None] | None = None) -> None:
        self.ctx = serving(request)
        self.engine = self.ctx.engine_for(model)
        self.request_id: str = request.state.request_id
        self.record: RequestRecord = request.state.record
        self._request = request
        self._restate = restate

    @contextlib.contextmanager
    def client_errors(self, prompt_param: str) -> Iterator[None]:
        """A ValueError raised inside (a bad field, a prompt over the context) is the client's error, naming the
        field its message names, else `prompt_param`."""
        try:
            yield
        except ValueError as exc:
            error = to_api_error(exc, prompt_param)
            self._restated(error)
            raise error from exc

    async def start(
        self, prompts: list[list[int]], params: SamplingParams, prompt_param: str, queue_timeout: float | None
    ) -> Streams:
        """The request's engine requests (start_streams), its prompt tokens counted in its record."""
        engine_id = self.ctx.engine_request_id(self.request_id)
        place = reserved_place(self._request)
        try:
            streams = await start_streams(self.engine, engine_id, prompts, params, prompt_param, queue_timeout, place)
        except APIError as error:
            self._restated(error)
            raise
        self.record.prompt_tokens = sum(len(prompt) for prompt in prompts)
        return streams

    async def collect(self, streams: Streams, n: int) -> list[CompletionOutput]:
        """The whole outputs (collect), unless the client hangs up first."""
        return await unless_disconnected(self._request, collect(streams, n, self.record))

    def _restated(self, error: APIError) -> None:
        if self._restate is not None:
            self._restate(error)


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
