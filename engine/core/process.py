"""How the engine core travels: on a thread beside the caller, or in a process of its own.

A process of its own is the default for servers and the offline API: the core's Python no longer shares a
GIL with HTTP and tokenization, and it starts with its own thread settings (OMP_WAIT_POLICY=PASSIVE before
torch loads) whatever its caller imported first. It is started with `python -m` rather than
multiprocessing, so it never re-imports the caller's main module, and it talks over a socketpair with
pickled messages (engine/core/messages.py). Either side going away ends the other: the core exits when its
socket closes, and the caller's receive() raises CoreGone when the core's does.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, NoReturn

from pagedserve.engine.child_python import module_command
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.messages import Command, CoreMessage, Emitted, Heartbeat, LogRecord, Shutdown

if TYPE_CHECKING:
    from pagedserve.engine.core.llm_engine import LLMEngine
    from pagedserve.engine.worker import LoadedModel

logger = logging.getLogger(__name__)


class CoreGone(RuntimeError):
    """The core ended without a word (its process exited or was killed, or its thread ended)."""


class CoreConnection(ABC):
    """The caller's end of an engine core: commands go in, CoreMessages come out, in order."""

    last_heard = 0.0  # time.monotonic() of the core's latest message, heartbeats included
    started = False

    def start(self, heartbeats: bool = False) -> None:
        """Starts the core; with `heartbeats`, once loaded it says Heartbeat every tenth of its heartbeat timeout,
        for a caller that reads all the time and watches its liveness (one that reads only while it waits for
        results, like the offline LLM, would find them piled up). A second call does nothing: `pagedserve
        serve` starts the core before it imports the server, and the AsyncEngine built later finds it running."""
        if not self.started:
            self.started = True
            self._start(heartbeats)

    @abstractmethod
    def _start(self, heartbeats: bool) -> None:
        """Starts the core's thread or process."""

    @abstractmethod
    def send(self, command: Command) -> None:
        """Thread-safe and never waits on the core; a core that is gone drops the command (receive() says so)."""

    def receive(self) -> CoreMessage:
        """Blocks for the next message; heartbeats only mark `last_heard`. Raises CoreGone once the core has ended."""
        while True:
            message = self._next()
            self.last_heard = time.monotonic()
            if not isinstance(message, Heartbeat):
                return message

    @abstractmethod
    def _next(self) -> Emitted:
        """Blocks for whatever the core sent next; raises CoreGone once it has ended."""

    @abstractmethod
    def join(self, timeout: float) -> None:
        """Waits for the core to end (after a Shutdown), then ends it by force."""

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts what the core runs, ends it and waits (up to `timeout`, then by force)."""
        self.send(Shutdown())
        self.join(timeout)


def connect_core(config: EngineConfig, loaded: LoadedModel | None = None) -> CoreConnection:
    """A core in a process of its own, unless the model is loaded here already or the config says not to."""
    if loaded is not None or not config.engine_process:
        from pagedserve.engine.core.llm_engine import LLMEngine

        return ThreadCore(lambda: LLMEngine(config, loaded))
    return ProcessCore(config)


class ThreadCore(CoreConnection):
    """The core on a thread of this process: for models loaded here already (tests, embedding)."""

    _END = object()

    def __init__(self, make_engine: Callable[[], LLMEngine]) -> None:
        self._make_engine = make_engine
        self._heartbeats = False
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)

    def _start(self, heartbeats: bool) -> None:
        self._heartbeats = heartbeats
        self._thread.start()

    def _run(self) -> None:
        from pagedserve.engine.core.loop import run_core

        try:
            run_core(self._make_engine, self._inbox, self._outbox.put, self._heartbeats)
        finally:
            self._outbox.put(self._END)

    def send(self, command: Command) -> None:
        self._inbox.put(command)

    def _next(self) -> Emitted:
        message = self._outbox.get()
        if message is self._END:
            self._outbox.put(self._END)  # every later receive() says so too
            raise CoreGone("the engine core's thread ended")
        return message  # type: ignore[return-value]

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)


@dataclass
class CoreSettings:
    """The first message to a core process."""

    config: EngineConfig
    log_level: int
    heartbeats: bool = False


class ProcessCore(CoreConnection):
    """The core in a child process (`python -m pagedserve.engine.core FD`)."""

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._process: subprocess.Popen | None = None
        self._connection: Connection | None = None
        # Commands go out from a thread of their own: a stopped core fills the socket's buffer, and a send that
        # waited for room would stall the caller's event loop (probes included) until the core resumed.
        self._commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="pagedserve-engine-writer", daemon=True)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def _start(self, heartbeats: bool) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            self._process = subprocess.Popen(
                module_command("pagedserve.engine.core", str(theirs.fileno())),
                pass_fds=[theirs.fileno()],  # the environment is ours: OMP_WAIT_POLICY is in it (openmp_policy)
                stdin=subprocess.DEVNULL,
            )
        self._connection = Connection(ours.detach())
        self._connection.send(CoreSettings(self._config, logging.getLogger().getEffectiveLevel(), heartbeats))
        self._writer.start()

    def send(self, command: Command) -> None:
        self._commands.put(command)

    def _write(self) -> None:
        assert self._connection is not None
        while (command := self._commands.get()) is not None:
            try:
                self._connection.send(command)
            except OSError:  # the core is gone: receive() says how
                return

    def _next(self) -> Emitted:
        assert self._connection is not None and self._process is not None, "start() first"
        while True:
            try:
                message = self._connection.recv()
            except (EOFError, OSError):
                raise CoreGone(f"the engine core process ended ({self._exit_status()})") from None
            if isinstance(message, LogRecord):
                logging.getLogger(message.record.name).handle(message.record)
                continue
            return message

    def _exit_status(self) -> str:
        assert self._process is not None
        try:
            code = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "its socket closed while it still runs"
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exit status {code}"

    def join(self, timeout: float) -> None:
        if self._process is None:
            return
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the engine core process did not stop within %.0f s; killing it", timeout)
            self._process.kill()
            self._process.wait()
        self._commands.put(None)  # the core has ended: the writer's send fails at once, or it takes this and ends
        if self._writer.is_alive():
            self._writer.join(timeout)
        if self._connection is not None:
            self._connection.close()


# ---- the core process's side ------------------------------------------------------------------------------


class _ForwardLogs(logging.handlers.QueueHandler):
    """Sends each log record to the caller, whose logging configuration formats and writes it."""

    def __init__(self, emit: Callable[[CoreMessage], None]) -> None:
        super().__init__(queue=None)  # type: ignore[arg-type]
        self._emit = emit

    def enqueue(self, record: logging.LogRecord) -> None:
        self._emit(LogRecord(record))


def serve_child(fd: int) -> None:
    """The core process's main: settings, then the core until Shutdown or until the caller goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the caller decides, not us
    connection = Connection(fd)
    settings: CoreSettings = connection.recv()
    lock = threading.Lock()

    def emit(message: Emitted) -> None:
        with lock:
            connection.send(message)

    root = logging.getLogger()
    root.handlers[:] = [_ForwardLogs(emit)]
    root.setLevel(settings.log_level)
    # The caller's work is short and waited on (admission, probes, each streamed token); the core's is long.
    # When both want a CPU the caller goes first, and an idle caller leaves the core every CPU. On 2 cores,
    # 5 levels took the p99 of a burst's 503s from 48-79 ms to 39-53 ms (benchmarks/isolation.py) and kept
    # serving throughput; 10 levels gave 42-48 ms but cost ~5% of it to a load client on the same host.
    os.nice(settings.config.engine_niceness)
    inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
    threading.Thread(target=_read_commands, args=(connection, inbox), name="pagedserve-inbox", daemon=True).start()

    from pagedserve.engine.core.llm_engine import LLMEngine
    from pagedserve.engine.core.loop import run_core

    # Held here past run_core: freeing the model and the KV cache block by block takes ~0.3 s that the exit
    # below makes pointless (the system takes the memory back at once).
    engines: list[LLMEngine] = []

    def make_engine() -> LLMEngine:
        engines.append(LLMEngine(settings.config))
        return engines[-1]

    run_core(make_engine, inbox, emit, settings.heartbeats)
    connection.close()
    exit_without_teardown(0)


def exit_without_teardown(code: int) -> NoReturn:
    """Ends this process now, once its work is done and its children are ended. The interpreter's own teardown
    would free every object of torch, transformers and the tokenizer one by one: 1.5-5 s of CPU for nothing
    (measured on an idle core process of the embedded model), which a container's stop grace pays for."""
    from pagedserve.engine.structured.sandbox import close_shared_sandboxes

    close_shared_sandboxes()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _read_commands(connection: Connection, inbox: queue.SimpleQueue[Command]) -> None:
    while True:
        try:
            inbox.put(connection.recv())
        except (EOFError, OSError):
            os._exit(0)  # the caller is gone (or closed us): nobody is left to serve
