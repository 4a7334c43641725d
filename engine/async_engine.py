"""AsyncEngine: runs an LLMEngine on its own thread and streams its deltas into asyncio.

Once started, only the engine thread touches the LLMEngine. Callers reach it through a thread-safe inbox
(adds, aborts, fail-alls) and read each request's deltas from an asyncio queue that the thread fills with
`call_soon_threadsafe`. The exceptions are read-only: the tokenizer (encode_prompt, encode_chat) and the
published `EngineSnapshot`.
A full waiting queue is refused on the caller's thread (QueuePlaces), without waiting for a step to end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable

from pagedserve.engine.async_stream import (
    AbortRequest,
    AddRequest,
    Command,
    EngineObserver,
    EngineSnapshot,
    EngineUnavailableError,
    FailAll,
    QueuePlaces,
    RequestSink,
    RequestStream,
    ResetPrefixCache,
    hand_over,
)
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.model_loader import LoadedModel
from pagedserve.engine.outputs import SequenceDelta
from pagedserve.engine.request import RequestStatus
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.tokenizer import Message

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, make_engine: Callable[[], LLMEngine]) -> None:
        """`make_engine` runs on the engine thread, so a server can listen while the model loads."""
        self._make_engine = make_engine
        self._engine: LLMEngine | None = None
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._sinks: dict[str, RequestSink] = {}  # engine thread only
        self._queue_places = QueuePlaces()  # sized once the engine has loaded
        self._observers: tuple[EngineObserver, ...] = ()
        self._snapshot = EngineSnapshot()
        self._lock = threading.Lock()  # orders submissions against stop and death
        self._accepting = False
        self._stopped = False
        self._settled = threading.Event()  # set once loading succeeded or failed
        self.error: BaseException | None = None  # what killed the engine thread
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)

    @classmethod
    def from_config(cls, config: EngineConfig, loaded: LoadedModel | None = None) -> AsyncEngine:
        return cls(lambda: LLMEngine(config, loaded))

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Blocks until the engine has loaded (True) or failed to (False)."""
        self._settled.wait(timeout)
        return self.is_ready

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops taking requests, aborts those in flight and joins the engine thread."""
        with self._lock:
            self._accepting = False
            self._stopped = True
            self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_ready(self) -> bool:
        return self._accepting

    @property
    def is_healthy(self) -> bool:
        return self.error is None

    # ---- read-only views ---------------------------------------------------------------------------

    @property
    def engine(self) -> LLMEngine:
        """The loaded LLMEngine, for its read-only parts (tokenizer, config, limits)."""
        if self._engine is None:
            raise EngineUnavailableError(self.unavailable_reason())
        return self._engine

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.engine.encode_prompt(prompt)

    def encode_chat(self, messages: list[Message]) -> list[int]:
        return self.engine.encode_chat(messages)

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def add_observer(self, observer: EngineObserver) -> None:
        self._observers = (*self._observers, observer)  # swapped whole: the engine thread reads it unlocked

    # ---- requests ----------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        queue_timeout: float | None = None,
    ) -> RequestStream:
        """Queues a request and returns its stream of deltas (an AsyncIterator[SequenceDelta]).

        Bad input (ValueError, ContextLengthError) and a full queue (QueueFullError) raise here, before
        any delta exists, so a server can still answer with an error status. Still unscheduled after
        `queue_timeout` or the config's max_queue_time, or unfinished after its request_timeout (seconds), the
        request is aborted and its stream raises QueueTimeoutError or RequestTimeoutError (checked every step).
        """
        config = self.engine.config
        start = time.monotonic()
        sink = RequestSink(
            asyncio.get_running_loop(), params.n, start, queue_timeout, config.max_queue_time, config.request_timeout
        )
        reply: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(AddRequest(request_id, prompt, params, sink, reply))
        try:
            await asyncio.wrap_future(reply)
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still go through after we stop waiting for it
            raise
        return RequestStream(request_id, params.n, sink.queue, self.abort)

    def abort(self, request_id: str) -> None:
        """Ends a request; its stream gets final deltas with finish_reason "abort". Thread-safe."""
        self._inbox.put(AbortRequest(request_id))

    def fail_all(self, error: BaseException) -> None:
        """Aborts every request in flight; their streams raise `error`. Thread-safe."""
        self._inbox.put(FailAll(error))

    async def reset_prefix_cache(self) -> int:
        """Forgets the prefix cache between two steps; returns how many cached blocks it dropped.

        Requests in flight keep their blocks; only later requests stop finding them.
        """
        reply: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._lock:
            if not self._accepting:
                raise EngineUnavailableError(self.unavailable_reason())
            self._inbox.put(ResetPrefixCache(reply))
        return await asyncio.wrap_future(reply)

    def _submit(self, command: AddRequest) -> None:
        with self._lock:
            if not self._accepting:
                raise EngineUnavailableError(self.unavailable_reason())
            command.sink.take_places(self._queue_places)
            self._inbox.put(command)

    def unavailable_reason(self) -> str:
        if self.error is not None:
            return f"the engine failed: {self.error!r}"
        if self._stopped:
            return "the engine is shutting down"
        return "the engine is still loading"

    # ---- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._engine = self._make_engine()
            self._queue_places.max_seats = self._engine.config.max_num_seqs
            self._queue_places.limit = self._engine.scheduler.queue_capacity()
            with self._lock:
                self._accepting = not self._stopped
            self._settled.set()
            while self._serve_once(self._engine):
                pass
        except BaseException as exc:  # whatever escapes the loop kills the engine: fail loudly, not silently
            logger.exception("the engine thread died")
            self._die(exc)

    def _serve_once(self, engine: LLMEngine) -> bool:
        """Runs the inbox's commands, then one step when there is work; blocks on the inbox when idle."""
        deltas: list[SequenceDelta] = []
        stopping = False
        for command in self._take_commands(block=not engine.has_unfinished_requests()):
            if command is None:
                stopping = True
                deltas += [d for request_id in list(self._sinks) for d in engine.abort_request(request_id)]
                break
            deltas += self._execute(engine, command)
        if not stopping:
            deltas += self._fail_expired(engine)
        if not stopping and engine.has_unfinished_requests():
            deltas += self._step(engine)
        self._release_queue_places(engine)
        # Published before the deltas go out: whoever sees a delta sees this state of the engine or a newer one.
        self._snapshot = EngineSnapshot.of(engine)
        self._deliver(deltas)
        return not stopping

    def _take_commands(self, block: bool) -> list[Command]:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _execute(
        self, engine: LLMEngine, command: AddRequest | AbortRequest | FailAll | ResetPrefixCache
    ) -> list[SequenceDelta]:
        """Returns the deltas it produced (an abort's final ones)."""
        if isinstance(command, AbortRequest):
            return engine.abort_request(command.request_id)
        if isinstance(command, ResetPrefixCache):
            command.reply.set_result(engine.reset_prefix_cache())
            return []
        if isinstance(command, FailAll):
            return [d for request_id in list(self._sinks) for d in self._fail(engine, request_id, command.error)]
        if not command.reply.set_running_or_notify_cancel():
            command.sink.leave_queue()
            return []  # the caller stopped waiting before we got here: never add it
        try:
            engine.add_request(command.request_id, command.prompt, command.params, command.sink.arrival)
        except Exception as exc:  # bad input or a full queue: the caller's error, not the engine's
            command.sink.leave_queue()
            command.reply.set_exception(exc)
            return []
        self._sinks[command.request_id] = command.sink
        command.reply.set_result(None)
        return []

    def _release_queue_places(self, engine: LLMEngine) -> None:
        """Frees the queue places of requests the scheduler has admitted, and resizes the queue to the seats
        the step left free."""
        # Shrink first, then free: a caller in between may be refused, but never admitted past the bound.
        self._queue_places.limit = engine.scheduler.queue_capacity()
        # Preempted requests wait again but were admitted once: they hold no queue places.
        waiting = {r.parent_id for r in engine.scheduler.waiting if r.status is RequestStatus.WAITING}
        for request_id, sink in self._sinks.items():
            if request_id not in waiting:
                sink.leave_queue()

    def _fail_expired(self, engine: LLMEngine) -> list[SequenceDelta]:
        """Ends the requests past a time limit (a wait to be scheduled, or the whole request's)."""
        now = time.monotonic()
        deltas = []
        for request_id, sink in list(self._sinks.items()):
            error = sink.expired(now)
            if error is not None:
                deltas += self._fail(engine, request_id, error)
        return deltas

    def _fail(self, engine: LLMEngine, request_id: str, error: BaseException) -> list[SequenceDelta]:
        """Aborts a request and ends its stream with `error` instead of the abort's deltas."""
        deltas = engine.abort_request(request_id)
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.leave_queue()
            sink.fail(error)
        return deltas

    def _step(self, engine: LLMEngine) -> list[SequenceDelta]:
        tokens_before = engine.runner.num_tokens_processed
        start = time.perf_counter()
        deltas = engine.step()
        seconds = time.perf_counter() - start
        num_tokens = engine.runner.num_tokens_processed - tokens_before
        self._notify(lambda observer: observer.on_step(seconds, num_tokens))
        return deltas

    def _deliver(self, deltas: list[SequenceDelta]) -> None:
        """Hands deltas to their queues: one wake-up per event loop, however many deltas."""
        if not deltas:
            return
        handed: list[tuple[RequestSink, SequenceDelta]] = []
        for delta in deltas:
            sink = self._sinks.get(delta.request_id)
            if sink is None:
                continue
            handed.append((sink, delta))
            if delta.finished:
                sink.num_unfinished -= 1
                if not sink.num_unfinished:
                    sink.leave_queue()
                    del self._sinks[delta.request_id]
        hand_over(handed)
        now = time.monotonic()
        self._notify(lambda observer: observer.on_deltas(deltas, now))

    def _notify(self, call: Callable[[EngineObserver], None]) -> None:
        for observer in self._observers:
            try:
                call(observer)
            except Exception:  # a broken observer must not take the engine down
                logger.exception("engine observer %r failed", observer)

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._accepting = False
            self.error = exc
            pending = self._take_commands(block=False)
        failure = EngineUnavailableError(self.unavailable_reason())
        for command in pending:
            if isinstance(command, AddRequest | ResetPrefixCache) and command.reply.set_running_or_notify_cancel():
                command.reply.set_exception(failure)
        for sink in self._sinks.values():
            sink.fail(failure)
        self._sinks.clear()
        self._settled.set()
