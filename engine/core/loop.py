"""EngineCore: the loop that owns an LLMEngine; commands in, one StepOutput per iteration out.

It runs wherever its transport puts it (engine/core/process.py): a process of its own for servers and the
offline API, or a thread beside the caller. Only this loop touches the LLMEngine.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.core.messages import (
    HEARTBEATS_PER_TIMEOUT,
    AbortRequests,
    AddRequest,
    CollectStats,
    Command,
    CoreFailed,
    Emitted,
    EngineInfo,
    EngineSnapshot,
    Heartbeat,
    Ready,
    Reply,
    ResetPrefixCache,
    Shutdown,
    StepOutput,
)
from pagedserve.engine.outputs import SequenceDelta
from pagedserve.engine.structured.lltokenizer import serialized_tokenizer
from pagedserve.engine.text.text_tokenizer import TokenizerSpec

logger = logging.getLogger(__name__)

Emit = Callable[[Emitted], None]


def run_core(
    make_engine: Callable[[], LLMEngine], inbox: queue.SimpleQueue[Command], emit: Emit, heartbeats: bool = False
) -> None:
    """Loads the engine, says Ready (or CoreFailed), then serves until Shutdown (with `heartbeats`, beating
    meanwhile). Never raises."""
    try:
        engine = make_engine()
    except BaseException as exc:  # the caller's side reports it; this side has nobody else to tell
        logger.exception("the engine failed to load")
        emit(CoreFailed(f"the model failed to load: {exc!r}"))
        return
    core = EngineCore(engine)
    heartbeat = Heartbeats(emit, engine.config.engine_heartbeat_timeout / HEARTBEATS_PER_TIMEOUT)
    emit(Ready(engine_info(engine), engine.snapshot()))
    if heartbeats:
        heartbeat.start()
    try:
        core.serve(inbox, emit)
    except BaseException as exc:
        logger.exception("the engine core died")
        heartbeat.stop()  # CoreFailed is the last word
        emit(CoreFailed(f"the engine failed: {exc!r}"))
    finally:
        heartbeat.stop()
        engine.close()  # ends the tensor-parallel ranks, whichever way the loop ended


class Heartbeats:
    """Says Heartbeat every `interval` seconds from a thread of its own, so that the caller can tell a wedged
    process (stopped, frozen, starved) from a busy one. A thread and not the loop: one step may take seconds
    (a long prefill on a CPU), and the forward's torch and ctypes calls release the GIL meanwhile. A loop stuck
    with the process still running is not its business (a lost tensor-parallel rank is check_health's)."""

    def __init__(self, emit: Emit, interval: float) -> None:
        self._emit = emit
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="pagedserve-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Returns once no beat can follow (idempotent)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _beat(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._emit(Heartbeat())
            except OSError:  # the caller is gone: the inbox's reader ends the process
                return


def engine_info(engine: LLMEngine) -> EngineInfo:
    return EngineInfo(
        model_dir=str(engine.loaded.model_dir),
        tokenizer=_tokenizer_spec(engine),
        trust_message_special_tokens=engine.config.trust_message_special_tokens,
        limits=engine.limits,
        max_queue_time=engine.config.max_queue_time,
        request_timeout=engine.config.request_timeout,
        num_kv_blocks=engine.kv.num_blocks,
        block_size=engine.kv.block_size,
        device=str(engine.loaded.device),
        pid=os.getpid(),
        heartbeat_timeout=engine.config.engine_heartbeat_timeout,
    )


class EngineCore:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queued: set[str] = set()  # added, not yet scheduled

    def serve(self, inbox: queue.SimpleQueue[Command], emit: Emit) -> None:
        while self.serve_once(inbox, emit):
            pass

    def serve_once(self, inbox: queue.SimpleQueue[Command], emit: Emit) -> bool:
        """Runs the inbox's commands, then one step when there is work (blocks on the inbox when idle)."""
        out = StepOutput(deltas=[], snapshot=EngineSnapshot())
        idle = not self.engine.has_unfinished_requests()
        commands = _take(inbox, block=idle, timeout=self.engine.health_check_seconds)
        if idle and not commands:  # woken to check on what runs beside the engine: a lost rank raises
            self.engine.check_health()
            return True
        for command in commands:
            if isinstance(command, Shutdown):
                out.deltas += self._abort(list(self.engine.request_ids()))
                out.snapshot = self.engine.snapshot()
                emit(out)
                return False
            self._execute(command, out, emit)
        if self.engine.has_unfinished_requests():
            self._step(out)
        out.admitted = self._take_admitted()
        out.snapshot = self.engine.snapshot()
        emit(out)
        return True

    def _execute(self, command: Command, out: StepOutput, emit: Emit) -> None:
        if isinstance(command, AddRequest):
            try:
                self.engine.add_request(command.request_id, command.token_ids, command.params, command.arrival)
            except Exception as exc:  # validated on the caller's side: only a caller's bug lands here
                logger.exception("could not add request %s", command.request_id)
                out.rejected.append((command.request_id, str(exc)))
            else:
                self._queued.add(command.request_id)
        elif isinstance(command, AbortRequests):
            out.deltas += self._abort(command.request_ids)
        elif isinstance(command, ResetPrefixCache):
            emit(Reply(command.reply_id, self.engine.reset_prefix_cache()))
        elif isinstance(command, CollectStats):
            emit(Reply(command.reply_id, self.engine.collect_stats(command.reset)))

    def _abort(self, request_ids: list[str]) -> list[SequenceDelta]:
        self._queued.difference_update(request_ids)
        return [delta for request_id in request_ids for delta in self.engine.abort_request(request_id)]

    def _step(self, out: StepOutput) -> None:
        tokens_before = self.engine.num_tokens_processed
        start = time.perf_counter()
        out.deltas += self.engine.step()
        out.step_seconds = time.perf_counter() - start
        out.num_tokens = self.engine.num_tokens_processed - tokens_before

    def _take_admitted(self) -> list[str]:
        """Requests scheduled since they were added (or that ended while waiting)."""
        if not self._queued:
            return []
        waiting = self.engine.waiting_request_ids()
        admitted = [request_id for request_id in self._queued if request_id not in waiting]
        self._queued.difference_update(admitted)
        return admitted


def _take(inbox: queue.SimpleQueue[Command], block: bool, timeout: float | None = None) -> list[Command]:
    """Every command waiting; when `block`, waits for the first (up to `timeout`, then returns none)."""
    commands: list[Command] = []
    if block:
        try:
            commands.append(inbox.get(timeout=timeout))
        except queue.Empty:
            return commands
    while True:
        try:
            commands.append(inbox.get_nowait())
        except queue.Empty:
            return commands


def _tokenizer_spec(engine: LLMEngine) -> TokenizerSpec:
    """The core's tokenizer as its callers get it: serialized as the engine loaded it, with --chat-template's
    template in place of its own where one is set."""
    tokenizer = engine.loaded.tokenizer
    spec = TokenizerSpec.of(tokenizer, serialized_tokenizer(tokenizer))
    template = engine.config.chat_template_text()
    return spec if template is None else dataclasses.replace(spec, chat_template=template)
