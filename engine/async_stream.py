"""What AsyncEngine hands its callers: request streams, engine snapshots, observer hooks, its one error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.outputs import SequenceDelta


class EngineUnavailableError(RuntimeError):
    """The engine takes no requests: it is still loading, it was shut down, or its thread died."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Counters published by the engine thread after every iteration, for metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks referenced by requests (idle cached blocks excluded)
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    num_preemptions: int = 0


class EngineObserver:
    """Hooks run on the engine thread after each step; keep them cheap. The server's metrics use them."""

    def on_step(self, seconds: float, num_tokens: int) -> None:
        """One LLMEngine.step took `seconds` and computed `num_tokens` tokens."""

    def on_deltas(self, deltas: list[SequenceDelta], now: float) -> None:
        """Deltas just handed to their requests (from a step or an abort); `now` is time.monotonic()."""


class RequestStream(AsyncIterator[SequenceDelta]):
    """The deltas of one request until all its n sequences finish.

    Closing it early, or cancelling the task that awaits it, aborts the request (the client went away).
    """

    def __init__(
        self, request_id: str, num_sequences: int, deltas: asyncio.Queue, abort: Callable[[str], None]
    ) -> None:
        self.request_id = request_id
        self._num_unfinished = num_sequences
        self._deltas = deltas
        self._abort = abort

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> SequenceDelta:
        if not self._num_unfinished:
            raise StopAsyncIteration
        try:
            item = await self._deltas.get()
        except asyncio.CancelledError:
            self.close()
            raise
        if isinstance(item, BaseException):
            self._num_unfinished = 0
            raise item
        if item.finished:
            self._num_unfinished -= 1
        return item

    def close(self) -> None:
        """Aborts the request unless it has finished; safe to call more than once."""
        if self._num_unfinished:
            self._num_unfinished = 0
            self._abort(self.request_id)

    async def aclose(self) -> None:
        self.close()
