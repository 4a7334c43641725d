"""Threads with a stack of a chosen size, for native code whose recursion depth follows its input, and at a lower
CPU priority where their work is in the background.

`threading.stack_size` applies to the threads started after it is set, process-wide; it is set around each
start here, under a lock, and put back. (A thread someone else starts in between gets the larger stack: harmless.)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_STACK_LOCK = threading.Lock()
Job = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...]]


def start_thread(target: Callable[[], None], name: str, stack_bytes: int) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    with _STACK_LOCK:
        previous = threading.stack_size(stack_bytes)
        try:
            thread.start()
        finally:
            threading.stack_size(previous)
    return thread


def lower_this_thread(niceness: int) -> None:
    """Raises the calling thread's nice value by `niceness` (at most 19), leaving its process's other threads as
    they are: on Linux each thread has a nice value of its own. Elsewhere, or when refused, nothing changes."""
    if sys.platform != "linux" or niceness <= 0:
        return
    thread = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + niceness))


class StackedThreads:
    """A small pool of daemon threads, each with a `stack_bytes` stack, started at the first job; `niceness`
    lowers their CPU priority below the rest of the process (lower_this_thread)."""

    def __init__(self, name: str, stack_bytes: int, num_threads: int = 1, niceness: int = 0) -> None:
        self._name = name
        self._stack_bytes = stack_bytes
        self._num_threads = num_threads
        self._niceness = niceness
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()

    def submit(self, call: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if not self._started:
                for index in range(self._num_threads):
                    work = functools.partial(_work, self._jobs, self._niceness)
                    start_thread(work, f"{self._name}-{index}", self._stack_bytes)
                self._started = True
        self._jobs.put((future, call, args))
        return future

    def close(self) -> None:
        """Ends the threads once the jobs queued so far are done."""
        for _ in range(self._num_threads):
            self._jobs.put(None)


def _work(jobs: queue.SimpleQueue[Job | None], niceness: int) -> None:
    lower_this_thread(niceness)
    while (job := jobs.get()) is not None:
        future, call, args = job
        if not future.set_running_or_notify_cancel():
            continue
        try:
            result = call(*args)
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)
        else:
            future.set_result(result)
        del job, future, call, args  # nothing of a finished job stays alive while the thread waits
