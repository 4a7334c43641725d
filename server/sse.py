"""Streaming answers as Server-Sent Events: chunks as deltas arrive, then usage, then `data: [DONE]`.

A stream that fails after it started cannot change its status any more: it ends with one
`data: {"error": {...}}` event and no [DONE] (the Responses API's streams end their own way, on the same
StreamFailure).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from pagedserve.engine import SequenceDelta
from pagedserve.server.errors import APIError, as_api_error
from pagedserve.server.generation import Streams, close_all, recorded
from pagedserve.server.protocol import Usage
from pagedserve.server.request_log import RequestRecord

Event = dict[str, str]


class ChunkFormatter(Protocol):
    """Turns deltas into one endpoint's chunk objects (chat and completions differ only here)."""

    def opening(self) -> Iterable[BaseModel]: ...

    def on_delta(self, choice: int, delta: SequenceDelta) -> Iterable[BaseModel]: ...

    def on_finish(self, choice: int, finish_reason: str) -> Iterable[BaseModel]:
        """What the choice held back, then its chunk with the finish_reason."""

    def on_usage(self, usage: Usage) -> BaseModel: ...


@dataclass
class StreamFailure:
    """Why a stream that had started failed, once it has (the error it ends with)."""

    error: APIError | None = None


@contextlib.contextmanager
def failure_recorded(record: RequestRecord) -> Iterator[StreamFailure]:
    """Around the part of a started stream that may fail, for the chat, completions and responses streams alike:
    a client hanging up (the stream torn down) is recorded as client_closed and raised on; any other exception
    stops there, recorded, as the StreamFailure's error, which the stream then ends with."""
    failure = StreamFailure()
    try:
        yield failure
    except asyncio.CancelledError:
        record.error_code = "client_closed"
        raise
    except Exception as exc:
        failure.error = as_api_error(exc)
        record.error_code = failure.error.code


def sse_response(events: AsyncIterator[Event], streams: Streams) -> EventSourceResponse:
    # The background task is the safety net when the stream never starts (client gone before the first byte).
    return EventSourceResponse(events, sep="\n", background=BackgroundTask(close_all, streams))


async def sse_events(
    formatter: ChunkFormatter,
    streams: Streams,
    n: int,
    record: RequestRecord,
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[Event]:
    """`continuous_usage` (vLLM's continuous_usage_stats): every chunk carries the usage so far, not only the
    last one."""
    exclude = None if include_usage else {"usage"}  # OpenAI sends "usage": null only when asked for usage

    def event(chunk: BaseModel) -> Event:
        if continuous_usage:
            chunk.usage = record.usage()  # type: ignore[attr-defined]  # chat and completions chunks have usage
        return {"data": chunk.model_dump_json(exclude=exclude)}

    async def on_delta_events(choice: int, delta: SequenceDelta) -> list[Event]:
        if delta.prompt_logprobs is None:
            return [event(chunk) for chunk in formatter.on_delta(choice, delta)]
        # A whole prompt's logprobs (thousands of tokens, each with its top k): formatted on a worker thread,
        # for the reason server/answers.py gives.
        return await asyncio.to_thread(lambda: [event(chunk) for chunk in formatter.on_delta(choice, delta)])

    for chunk in formatter.opening():
        yield event(chunk)
    with failure_recorded(record) as failure:
        async with contextlib.aclosing(recorded(streams, record)) as deltas:
            async for prompt_index, delta in deltas:
                choice = prompt_index * n + delta.index
                for formatted in await on_delta_events(choice, delta):
                    yield formatted
                if delta.finish_reason is not None:
                    for chunk in formatter.on_finish(choice, delta.finish_reason):
                        yield event(chunk)
    if failure.error is not None:
        yield {"data": json.dumps(failure.error.body())}
        return
    if include_usage:
        yield event(formatter.on_usage(record.usage()))
    yield {"data": "[DONE]"}
