"""AsyncEngine: the engine's asyncio API. It validates and tokenizes requests here and streams their deltas
from an engine core (engine/core/loop.py) that runs in a process of its own, or on a thread for a model that is
already loaded in this process.

Requests are checked once, here (engine/validation.py), so bad input and a full waiting queue fail at once
on the caller's side. One reader thread takes the core's outputs and hands each request's deltas to its
asyncio queue with `call_soon_threadsafe`; it also keeps the published EngineSnapshot and runs observers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedserve.engine.client.async_stream import (
    EngineObserver,
    EngineUnavailableError,
    QueuePlaces,
    RequestSink,
    RequestStream,
    Reservation,
    hand_over,
)
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    EngineInfo,
    EngineSnapshot,
    Ready,
    Reply,
    ResetPrefixCache,
    Shutdown,
    StepOutput,
)
from pagedserve.engine.core.process import CoreConnection, CoreGone, ThreadCore, connect_core
from pagedserve.engine.outputs import SequenceDelta
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured.grammar import GrammarCompiler
from pagedserve.engine.text.tokenizer import Message, PromptTokenizer
from pagedserve.engine.text.tool_template import Tool
from pagedserve.engine.validation import RequestLimits, check_request

if TYPE_CHECKING:  # the caller's side stays torch-free: only a core on a thread of this process needs these
    from pagedserve.engine.core.llm_engine import LLMEngine
    from pagedserve.engine.worker import LoadedModel

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, core: CoreConnection) -> None:
        self._core = core
        self._sinks: dict[str, RequestSink] = {}  # requests in flight; guarded by _lock
        self._queue_places = QueuePlaces()  # sized once the core has loaded
        self._observers: tuple[EngineObserver, ...] = ()
        self._snapshot = EngineSnapshot()
        self._lock = threading.Lock()  # orders submissions against stop and death
        self._accepting = False
        self._stopped = False
        self._settled = threading.Event()  # set once loading succeeded or failed
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._reply_ids = itertools.count()
        self._on_death: list[Callable[[], None]] = []
        self._info: EngineInfo | None = None
        self._tokenizer: PromptTokenizer | None = None
        self._grammars: GrammarCompiler | None = None  # checks constraints at the door
        self.error: str | None = None  # why the core died
        self._ready_at = 0.0  # time.monotonic() when it began to take requests
        self._wedge_logged = False
        self._reader = threading.Thread(target=self._read, name="pagedserve-engine-client", daemon=True)

    @classmethod
    def from_config(cls, config: EngineConfig, loaded: LoadedModel | None = None) -> AsyncEngine:
        """The core in a process of its own, unless the model is loaded here already or config says not to."""
        return cls(connect_core(config, loaded))

    @classmethod
    def in_thread(cls, make_engine: Callable[[], LLMEngine]) -> AsyncEngine:
        """The core on a thread of this process; `make_engine` runs there, so a server listens while it loads."""
        return cls(ThreadCore(make_engine))

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> AsyncEngine:
        self._core.start(heartbeats=True)  # the reader reads all the time; is_healthy watches them
        self._reader.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Blocks until the engine has loaded (True) or failed to (False)."""
        self._settled.wait(timeout)
        return self.is_ready

    def on_death(self, callback: Callable[[], None]) -> None:
        """`callback` runs (on the reader thread) if the core dies or fails to load; not after shutdown()."""
        self._on_death.append(callback)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops taking requests, aborts those in flight and waits for the core to end."""
        with self._lock:
            self._accepting = False
            self._stopped = True
        self._core.stop(timeout)
        if self._reader.is_alive():
            self._reader.join(timeout)

    @property
    def is_ready(self) -> bool:
        return self._accepting and not self._wedged()

    @property
    def is_healthy(self) -> bool:
        """False once the core has died, and while it is wedged; loading and shut down count as alive."""
        return self.error is None and not self._wedged()

    def unavailable_reason(self) -> str:
        if self.error is not None:
            return self.error
        if self._stopped:
            return "the engine is shutting down"
        if self._wedged():
            return f"the engine core has not answered for {self._silence():.0f} s"
        return "the engine is still loading"

    def _wedged(self) -> bool:
        """Loaded, yet silent past its heartbeat timeout: the core's process no longer runs (SIGSTOP, a frozen or
        starved host). Its heartbeat comes from a thread of its own, so a long step is no silence."""
        info = self._info
        wedged = self._accepting and info is not None and self._silence() > info.heartbeat_timeout
        if wedged != self._wedge_logged and self._accepting:  # once each way, when a probe or request sees it
            self._wedge_logged = wedged
            (logger.error if wedged else logger.warning)(
                "the engine core %s", "has stopped answering" if wedged else "answers again"
            )
        return wedged

    def _silence(self) -> float:
        """Seconds since the core's latest message (or since the engine was ready, if later)."""
        return time.monotonic() - max(self._core.last_heard, self._ready_at)

    # ---- what the loaded engine is -----------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineUnavailableError(self.unavailable_reason())
        return self._info

    @property
    def limits(self) -> RequestLimits:
        return self.info.limits

    @property
    def tokenizer(self) -> PromptTokenizer:
        if self._tokenizer is None:
            raise EngineUnavailableError(self.unavailable_reason())
        return self._tokenizer

    async def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt, tokenized off the event loop (a big body must not stall other requests)."""
        if not isinstance(prompt, str):
            return list(prompt)
        return await self.tokenizer.encode_async(prompt, add_special_tokens)

    async def encode_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[Tool] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        return await self.tokenizer.encode_chat_async(
            messages, add_generation_prompt, continue_final_message, tools, template_kwargs, add_special_tokens
        )

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def add_observer(self, observer: EngineObserver) -> None:
        self._observers = (*self._observers, observer)  # swapped whole: the reader thread reads it unlocked

    # ---- requests ----------------------------------------------------------------------------------

    def queue_places_held(self) -> int:
        """Sequences waiting to be scheduled, and places reserved for requests not yet submitted."""
        return self._queue_places.held

    def reserve_place(self) -> Reservation | None:
        """A place in the waiting queue held for a request before any work on it (a server reserves before
        parsing the body), or QueueFullError at once. Hand it to generate(), which takes it; release() it if
        the request never gets there. None while the engine takes nothing (generate() says why)."""
        return self._queue_places.reserve() if self.is_ready else None

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        queue_timeout: float | None = None,
        reservation: Reservation | None = None,
    ) -> RequestStream:
        """Queues a request and returns its stream of deltas (an AsyncIterator[SequenceDelta]).

        Bad input (ValueError, ContextLengthError), a full queue (QueueFullError) and an engine that takes
        nothing (EngineUnavailableError) raise here, before any delta exists, so a server can still answer
        with an error status. Still unscheduled after `queue_timeout` or the config's max_queue_time, or
        unfinished after its request_timeout (seconds), the request is aborted and its stream raises
        QueueTimeoutError or RequestTimeoutError (timed on this process's clock, whatever the core does).
        """
        token_ids = await self.encode_prompt(prompt)
        info = self.info
        check_request(info.limits, token_ids, params)
        if params.structured_output is not None and self._grammars is not None:
            await asyncio.to_thread(self._grammars.check, params.structured_output)  # ~1 ms; the first builds
        sink = RequestSink(
            asyncio.get_running_loop(),
            params.n,
            time.monotonic(),
            queue_timeout,
            info.max_queue_time,
            info.request_timeout,
        )
        with self._lock:
            if not self.is_ready:
                raise EngineUnavailableError(self.unavailable_reason())
            if request_id in self._sinks:
                raise ValueError(f"request id {request_id!r} is already in use")
            sink.take_places(self._queue_places, reservation)
            self._sinks[request_id] = sink
            self._watch(request_id, sink)
            self._core.send(AddRequest(request_id, token_ids, params, sink.arrival))
        return RequestStream(request_id, params.n, sink.queue, self.abort)

    def abort(self, request_id: str) -> None:
        """Ends a request; its stream gets final deltas with finish_reason "abort". Thread-safe."""
        self._core.send(AbortRequests([request_id]))

    def fail_all(self, error: BaseException) -> None:
        """Ends every request in flight; their streams raise `error`. Thread-safe."""
        with self._lock:
            failed = list(self._sinks.items())
            self._sinks.clear()
        for _, sink in failed:
            sink.end()
            sink.fail(error)
        if failed:
            self._core.send(AbortRequests([request_id for request_id, _ in failed]))

    async def reset_prefix_cache(self) -> int:
        """Forgets the prefix cache between two steps; returns how many cached blocks it dropped.

        Requests in flight keep their blocks; only later requests stop finding them.
        """
        reply: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._lock:
            if not self.is_ready:
                raise EngineUnavailableError(self.unavailable_reason())
            reply_id = next(self._reply_ids)
            self._replies[reply_id] = reply
        self._core.send(ResetPrefixCache(reply_id))
        return await asyncio.wrap_future(reply)

    # ---- the reader thread -------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                message = self._core.receive()
                if isinstance(message, StepOutput):
                    self._on_output(message)
                elif isinstance(message, Ready):
                    self._on_ready(message)
                elif isinstance(message, Reply):
                    self._replies.pop(message.reply_id).set_result(message.value)
                elif isinstance(message, CoreFailed):
                    self._die(message.reason)
                    return
        except CoreGone as exc:
            self._die(str(exc))
        except BaseException as exc:  # a bug on this side: fail loudly, never leave streams waiting
            logger.exception("the engine client's reader failed")
            self._die(f"the engine client failed: {exc!r}")

    def _on_ready(self, ready: Ready) -> None:
        try:
            self._tokenizer = PromptTokenizer.from_spec(ready.info.tokenizer, ready.info.trust_message_special_tokens)
            self._grammars = GrammarCompiler(self._tokenizer.tokenizer, ready.info.limits.vocab_size, frozenset())
        except Exception as exc:
            logger.exception("the tokenizer failed to load")
            self._die(f"the tokenizer failed to load: {exc!r}")
            self._core.send(Shutdown())
            return
        self._info = ready.info
        self._snapshot = ready.snapshot
        self._queue_places.limit = ready.snapshot.queue_capacity
        with self._lock:
            self._accepting = not self._stopped
            self._ready_at = time.monotonic()  # the beats that came while the tokenizer loaded are still unread
        self._settled.set()

    def _on_output(self, out: StepOutput) -> None:
        # Shrink the queue's bound first, then free places: a caller in between may be refused, never admitted
        # past the bound.
        self._queue_places.limit = out.snapshot.queue_capacity
        with self._lock:
            admitted = [self._sinks.get(request_id) for request_id in out.admitted]
            rejected = [(self._sinks.pop(request_id, None), why) for request_id, why in out.rejected]
        for sink in admitted:
            if sink is not None:
                sink.leave_queue()
        for sink, why in rejected:
            if sink is not None:
                sink.end()
                sink.fail(ValueError(why))
        # Published before the deltas go out: whoever sees a delta sees this state of the core or a newer one.
        self._snapshot = out.snapshot
        if out.step_seconds is not None:
            seconds, num_tokens = out.step_seconds, out.num_tokens
            self._notify(lambda observer: observer.on_step(seconds, num_tokens))
        self._deliver(out.deltas)

    def _deliver(self, deltas: list[SequenceDelta]) -> None:
        """Hands deltas to their queues: one wake-up per event loop, however many deltas."""
        if not deltas:
            return
        handed: list[tuple[RequestSink, SequenceDelta]] = []
        with self._lock:
            for delta in deltas:
                sink = self._sinks.get(delta.request_id)
                if sink is None:
                    continue
                handed.append((sink, delta))
                if delta.finished:
                    sink.num_unfinished -= 1
                    if not sink.num_unfinished:
                        sink.end()
                        del self._sinks[delta.request_id]
        hand_over(handed)
        now = time.monotonic()
        self._notify(lambda observer: observer.on_deltas(deltas, now))

    def _watch(self, request_id: str, sink: RequestSink) -> None:
        """Times the request's next deadline on its event loop, so that limits hold on this process's clock
        whether or not the core sends anything. Under the lock."""
        sink.watch(lambda: self._expire(request_id, sink))

    def _expire(self, request_id: str, sink: RequestSink) -> None:
        """A deadline of the request has come (on its event loop): ends it, unless it ended or has more time."""
        with self._lock:
            if self._sinks.get(request_id) is not sink:
                return
            error = sink.expired(time.monotonic())
            if error is None:  # scheduled before its wait ran out: what is left is the whole request's limit
                self._watch(request_id, sink)
                return
            del self._sinks[request_id]
        sink.end()
        sink.fail(error)
        self._core.send(AbortRequests([request_id]))

    def _notify(self, call: Callable[[EngineObserver], None]) -> None:
        for observer in self._observers:
            try:
                call(observer)
            except Exception:  # a broken observer must not take the engine down
                logger.exception("engine observer %r failed", observer)

    def _die(self, reason: str) -> None:
        with self._lock:
            stopping = self._stopped
            self._accepting = False
            if not stopping:
                self.error = reason
            sinks = list(self._sinks.values())
            self._sinks.clear()
            replies = list(self._replies.values())
            self._replies.clear()
        failure = EngineUnavailableError(self.unavailable_reason())
        for sink in sinks:
            sink.end()
            sink.fail(failure)
        for reply in replies:
            reply.set_exception(failure)
        self._settled.set()
        if not stopping:
            logger.error("the engine is unavailable: %s", reason)
            for callback in self._on_death:
                callback()
