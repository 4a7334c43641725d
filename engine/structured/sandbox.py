"""A small pool of child processes that compile each grammar before this process does (sandbox_child.py).

llguidance is native code: a grammar that overflows its stack kills the process with SIGSEGV, and no bound on
one shape of input (links of `$ref`, chained rules) covers them all. So every new grammar is compiled in a
child first: a child that dies or hangs is replaced and the grammar is refused as too complex; one that
compiles there is proven, for the same library, input and limits, on a smaller stack than this process uses.
Verdicts are cached by the constraint's digest: an input that crashed a child costs no restarts a second time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.engine.structured.sandbox_child import HEADER_BYTES, encode_message

logger = logging.getLogger(__name__)

CHILD_SCRIPT = Path(__file__).with_name("sandbox_child.py")
START_SECONDS = 120.0  # a child's start: Python, llguidance and the tokenizer's trie (~1.5 s idle)
JUDGE_SECONDS = 60.0  # one grammar; the largest legitimate ones take a few seconds


Source = tuple[str, str, str]  # a StructuredOutput's kind, spec and thinking


@dataclass(frozen=True)
class Verdict:
    error: str | None  # None: the grammar compiled and its first mask was probed
    stage: str  # "compile" (the library refused it), "probe" (a limit at the first tokens), "crash", "timeout"
    grammar: str | None = None  # llguidance's text of it, when asked for (never cached: it may be large)


class ChildLost(Exception):
    """The child died ("crash") or ran out of time ("timeout") on a job; the message says how."""

    def __init__(self, why: str, stage: str = "crash") -> None:
        super().__init__(why)
        self.stage = stage


class Child:
    """One sandbox process, talked to over its stdin and stdout."""

    def __init__(self, config: bytes) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-I", str(CHILD_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
        )
        try:
            self._send_raw(config)
            self._receive(START_SECONDS)
        except BaseException:
            self.kill()
            raise

    def run(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        self._send_raw(encode_message(job))
        return self._receive(timeout)

    def kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None:
                stream.close()

    def _send_raw(self, data: bytes) -> None:
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(data)
        except (BrokenPipeError, ConnectionResetError, ValueError):
            raise ChildLost(self._how_it_ended()) from None

    def _receive(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        header = self._read_exactly(HEADER_BYTES, deadline, timeout)
        return json.loads(self._read_exactly(int.from_bytes(header, "big"), deadline, timeout))

    def _read_exactly(self, size: int, deadline: float, timeout: float) -> bytes:
        assert self._process.stdout is not None
        fd, data = self._process.stdout.fileno(), b""
        while len(data) < size:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                self.kill()
                raise ChildLost(f"compiling it took over {timeout:.0f} s", "timeout")
            chunk = os.read(fd, size - len(data))
            if not chunk:
                raise ChildLost(self._how_it_ended())
            data += chunk
        return data

    def _how_it_ended(self) -> str:
        code = self._process.wait()
        if code < 0:
            try:
                return f"it crashed the grammar compiler ({signal.Signals(-code).name})"
            except ValueError:
                return f"it crashed the grammar compiler (signal {-code})"
        return f"the grammar compiler exited with status {code}"


class GrammarSandbox:
    """Judges grammars in up to `size` children at once; a child is started at its first job and after a loss."""

    def __init__(self, config: dict[str, Any], size: int = 2, cache_size: int = 4096) -> None:
        self._config = encode_message(config)
        self._slots: queue.SimpleQueue[Child | None] = queue.SimpleQueue()
        for _ in range(size):
            self._slots.put(None)
        self._verdicts: OrderedDict[bytes, Verdict] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._children: set[Child] = set()  # every live child, for the finalizer
        self._finalizer = weakref.finalize(self, _kill_all, self._children)

    def judge(self, source: Source, want_grammar: bool = False) -> Verdict:
        """Blocks while every child is busy. RuntimeError only when a child cannot be started at all."""
        key = hashlib.sha256(json.dumps(source).encode()).digest()
        found = self._cached(key)
        if found is not None and (found.error is not None or not want_grammar):
            return found
        child = self._slots.get()
        try:
            found = self._cached(key)  # judged while this call waited for a child
            if found is not None and (found.error is not None or not want_grammar):
                return found
            job = {"source": source, "compile": found is None, "want_grammar": want_grammar}
            child, verdict = self._run(child, job)
            if verdict.stage == "crash":  # once more, on a fresh child: one killed from outside (OOM) is no verdict
                child, verdict = self._run(child, job)
        finally:
            self._slots.put(child)
        if found is None:
            self._remember(key, Verdict(verdict.error, verdict.stage))
        return verdict

    def close(self) -> None:
        """Ends the children (a later judge() starts new ones)."""
        _kill_all(self._children)

    def _cached(self, key: bytes) -> Verdict | None:
        with self._lock:
            found = self._verdicts.get(key)
            if found is not None:
                self._verdicts.move_to_end(key)
            return found

    def _remember(self, key: bytes, verdict: Verdict) -> None:
        with self._lock:
            self._verdicts[key] = verdict
            if len(self._verdicts) > self._cache_size:
                self._verdicts.popitem(last=False)

    def _run(self, child: Child | None, job: dict[str, Any]) -> tuple[Child | None, Verdict]:
        try:
            if child is None:
                child = Child(self._config)
                self._children.add(child)
            reply = child.run(job, JUDGE_SECONDS)
        except ChildLost as lost:
            logger.warning("the grammar sandbox lost a child: %s", lost)
            if child is not None:
                child.kill()
                self._children.discard(child)
                return None, Verdict(str(lost), lost.stage)
            raise RuntimeError(f"the grammar sandbox could not start: {lost}") from None
        except OSError as exc:
            raise RuntimeError(f"the grammar sandbox could not start: {exc}") from None
        return child, Verdict(reply["error"], reply["stage"], reply["grammar"])


def _kill_all(children: set[Child]) -> None:
    for child in list(children):
        child.kill()
    children.clear()


_SHARED: OrderedDict[bytes, GrammarSandbox] = OrderedDict()
_SHARED_LOCK = threading.Lock()


def shared_sandbox(config: dict[str, Any], keep: int = 4) -> GrammarSandbox:
    """One sandbox per configuration in this process: the API's checks and an in-thread core share children,
    and so do the engines a test suite builds one after another. The least recent beyond `keep` is closed."""
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).digest()
    with _SHARED_LOCK:
        sandbox = _SHARED.get(key)
        if sandbox is None:
            sandbox = _SHARED[key] = GrammarSandbox(config)
            while len(_SHARED) > keep:
                _SHARED.popitem(last=False)[1].close()
        _SHARED.move_to_end(key)
        return sandbox


def close_shared_sandboxes() -> None:
    """Ends every shared sandbox's children: for a process about to exit without its interpreter's teardown,
    which is where their finalizers would otherwise run."""
    with _SHARED_LOCK:
        for sandbox in _SHARED.values():
            sandbox.close()
