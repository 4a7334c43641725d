"""Both ends of a request's stream in the caller's process: the sink that AsyncEngine's reader thread fills
from the core's outputs, and the RequestStream that the caller reads; the waiting queue's places, observers,
errors."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pagedserve.engine.outputs import SequenceDelta
from pagedserve.engine.validation import QueueFullError


class EngineUnavailableError(RuntimeError):
    """The engine takes no requests: it is still loading, it was shut down, or its core died."""


class QueueTimeoutError(TimeoutError):
    """The request was not scheduled in time: within its own queue timeout (`requested`), or max_queue_time."""

    def __init__(self, message: str, requested: bool) -> None:
        super().__init__(message)
        self.requested = requested


class RequestTimeoutError(TimeoutError):
    """The request did not finish within its timeout; it was aborted."""


class EngineObserver:
    """Hooks run on AsyncEngine's reader thread after each core iteration; keep them cheap (the server's metrics)."""

    def on_step(self, seconds: float, num_tokens: int) -> None:
        """One LLMEngine.step took `seconds` and computed `num_tokens` tokens."""

    def on_deltas(self, deltas: list[SequenceDelta], now: float) -> None:
        """Deltas just handed to their requests (from a step or an abort); `now` is time.monotonic()."""


@dataclass
class RequestSink:
    """The reader thread's end of one request's stream: an asyncio queue living on `loop`, and time limits
    timed on that loop (AsyncEngine arms the timer; whoever removes the sink from the engine's calls end())."""

    loop: asyncio.AbstractEventLoop
    num_sequences: int  # n: what the request counts against max_queue_len while it waits
    arrival: float  # time.monotonic()
    queue_timeout: float | None = None  # the request's own limit on its wait to be scheduled, in seconds
    max_queue_time: float | None = None  # the engine's limit on that wait
    timeout: float | None = None  # seconds it may take in all
    queue: asyncio.Queue[SequenceDelta | BaseException] = field(default_factory=asyncio.Queue)
    num_unfinished: int = field(init=False)  # sequences still to finish
    places: QueuePlaces | None = None  # the queue places it holds until first scheduled
    timer: asyncio.TimerHandle | None = None  # for its next deadline

    def __post_init__(self) -> None:
        self.num_unfinished = self.num_sequences

    @property
    def queued(self) -> bool:
        return self.places is not None

    def take_places(self, places: QueuePlaces, reservation: Reservation | None = None) -> None:
        places.take(self.num_sequences, reservation)
        self.places = places

    def leave_queue(self) -> None:
        """Gives its queue places back (once): it has been scheduled, or it has ended."""
        if self.places is not None:
            self.places.free(self.num_sequences)
            self.places = None

    def next_deadline(self) -> float | None:
        """When (time.monotonic()) the first of its limits that still applies runs out; None without one."""
        limits = [self.timeout, *((self.queue_timeout, self.max_queue_time) if self.queued else ())]
        seconds = [limit for limit in limits if limit is not None]
        return self.arrival + min(seconds) if seconds else None

    def watch(self, on_expiry: Callable[[], None]) -> None:
        """Calls `on_expiry` on the sink's loop once its next deadline has come, if it has one. On that loop."""
        deadline = self.next_deadline()
        if deadline is not None:
            self.timer = self.loop.call_later(max(0.0, deadline - time.monotonic()), on_expiry)

    def end(self) -> None:
        """This side is done with the request: its queue places back, its timer off. Thread-safe."""
        self.leave_queue()
        if self.timer is not None:
            call_soon(self.loop, self.timer.cancel)

    def expired(self, now: float) -> TimeoutError | None:
        """The error to end the request with, if it has run past one of its limits."""
        waited = now - self.arrival
        if self.queued and self.queue_timeout is not None and waited >= self.queue_timeout:
            return QueueTimeoutError(f"the request was not scheduled within its {self.queue_timeout:g} s", True)
        if self.queued and self.max_queue_time is not None and waited >= self.max_queue_time:
            return QueueTimeoutError(f"the request was not scheduled within {self.max_queue_time:g} s", False)
        if self.timeout is not None and waited >= self.timeout:
            return RequestTimeoutError(f"the request did not finish within {self.timeout:g} s")
        return None

    def fail(self, error: BaseException) -> None:
        """Ends the caller's stream with `error` (thread-safe)."""
        call_soon(self.loop, self.queue.put_nowait, error)


class QueuePlaces:
    """The waiting queue's bound, kept on the caller's side so that a full queue is refused at once.

    Each of a request's n sequences takes a place, from submission until the scheduler first admits the
    request. `limit` follows the scheduler's queue capacity (max_queue_len plus the running batch's free
    seats) as of the last step. A request may reserve one place before any work on it (a server, before it
    parses the body): in a burst, the requests beyond the places are refused before the others' parsing and
    tokenization, not after. Thread-safe.
    """

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self._taken = 0
        self._reserved = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Places reserved or taken now: with nothing waiting and nothing being submitted, 0."""
        with self._lock:
            return self._taken + self._reserved

    def reserve(self) -> Reservation:
        """One place held for a request about to be submitted; QueueFullError when none is left."""
        with self._lock:
            self._refuse_beyond(1)
            self._reserved += 1
        return Reservation(self)

    def take(self, num_sequences: int, reservation: Reservation | None = None) -> None:
        """Takes the request's places, its reservation (if still held) counting as one of them."""
        with self._lock:
            held = reservation is not None and reservation.held
            self._refuse_beyond(num_sequences - held)
            if held:
                assert reservation is not None
                reservation.held = False
                self._reserved -= 1
            self._taken += num_sequences

    def _refuse_beyond(self, more: int) -> None:
        if self._taken + self._reserved + more > self.limit:
            waiting = f"{self._taken} of {self.limit} sequences wait, {self._reserved} more are being submitted"
            raise QueueFullError(f"the waiting queue is full: {waiting}")

    def unreserve(self, reservation: Reservation) -> None:
        with self._lock:
            if reservation.held:
                reservation.held = False
                self._reserved -= 1

    def free(self, num_sequences: int) -> None:
        with self._lock:
            self._taken -= num_sequences


class Reservation:
    """A place held from before a request's body is read until it is submitted or answered otherwise."""

    def __init__(self, places: QueuePlaces) -> None:
        self._places = places
        self.held = True

    def release(self) -> None:
        """Gives the place back unless the request took it (idempotent)."""
        self._places.unreserve(self)


def hand_over(items: list[tuple[RequestSink, SequenceDelta]]) -> None:
    """Puts deltas on their sinks' queues: one thread-safe wake-up per event loop, however many deltas."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestSink, SequenceDelta]]] = defaultdict(list)
    for sink, delta in items:
        batches[sink.loop].append((sink, delta))
    for loop, batch in batches.items():
        call_soon(loop, _put_all, batch)


def _put_all(batch: list[tuple[RequestSink, SequenceDelta]]) -> None:
    for sink, delta in batch:
        sink.queue.put_nowait(delta)


def call_soon(loop: asyncio.AbstractEventLoop, callback: Callable, *args: object) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is left to read these deltas
        loop.call_soon_threadsafe(callback, *args)


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
