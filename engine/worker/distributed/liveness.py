"""Liveness beside the collectives: every rank but 0 beats a counter in rank 0's store; rank 0 watches them.

A collective cannot tell a slow rank from a hung one, and gloo waits its whole timeout. So each rank's
heartbeat thread adds to `heartbeat/<rank>` every HEARTBEAT_SECONDS, and exits its process when the store is
gone (rank 0 died) or says `abort`. Rank 0's monitor thread declares a rank lost when its process exits or
its counter stands still for HANG_SECONDS; it then kills the ranks it started (which makes any collective rank
0 is waiting in fail at once), tells the others to abort, and keeps the reason for `check()` to raise.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time

import torch.distributed as dist

from pagedserve.engine.worker.distributed.rendezvous import Rendezvous, connect_store

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 0.5
HANG_SECONDS = 10.0  # a rank's heartbeat thread needs the GIL only briefly: 10 s of silence is a hung process
FIRST_BEAT_SECONDS = 120.0  # a rank imports torch before its first beat: slow on a busy host
ABORT_KEY = "abort"


class RankLostError(RuntimeError):
    """A tensor-parallel rank died or hung: the ranks can no longer run a step together."""


def start_heartbeat(rendezvous: Rendezvous, rank: int) -> None:
    """Beats for this rank until the process ends; ends the process when rank 0 is gone or says abort."""

    def beat() -> None:
        try:
            store = connect_store(rendezvous)
            while True:
                store.add(f"heartbeat/{rank}", 1)
                if store.check([ABORT_KEY]):
                    logger.error("rank 0 ended the tensor-parallel group; exiting")
                    os._exit(1)
                time.sleep(HEARTBEAT_SECONDS)
        except Exception as exc:  # the store lives in rank 0: it is gone
            logger.error("lost rank 0 (%s); exiting", exc.__class__.__name__)
            os._exit(1)

    threading.Thread(target=beat, name="pagedserve-heartbeat", daemon=True).start()


class RankMonitor:
    """Rank 0's watch over ranks 1..size-1 (`processes`: those it started itself, which it may kill)."""

    def __init__(self, rendezvous: Rendezvous, processes: dict[int, subprocess.Popen]) -> None:
        self._rendezvous = rendezvous
        self._processes = processes
        self._stopped = threading.Event()
        self.failure: str | None = None
        self._thread = threading.Thread(target=self._watch, name="pagedserve-rank-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops watching (before a clean shutdown, whose exits are no failures)."""
        self._stopped.set()
        self._thread.join(timeout=5)

    def check(self) -> None:
        if self.failure is not None:
            raise RankLostError(self.failure)

    def wait_for_failure(self, timeout: float) -> str | None:
        """The failure's reason, waiting up to `timeout` for the monitor to see what a collective already has."""
        deadline = time.monotonic() + timeout
        while self.failure is None and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        return self.failure

    def _watch(self) -> None:
        try:
            store = connect_store(self._rendezvous)
            started = time.monotonic()
            seen = {rank: (-1, started) for rank in range(1, self._rendezvous.world_size)}
            while not self._stopped.wait(HEARTBEAT_SECONDS):
                now = time.monotonic()
                for rank, (count, since) in seen.items():
                    latest = store.add(f"heartbeat/{rank}", 0)
                    if latest != count:
                        seen[rank] = (latest, now)
                    elif (reason := self._lost(rank, count, now - since)) is not None:
                        self._fail(store, reason)
                        return
        except Exception as exc:  # our own store failing: nothing can be run together any more
            if not self._stopped.is_set():
                self._fail(None, f"the tensor-parallel store failed: {exc!r}")

    def _lost(self, rank: int, count: int, silent: float) -> str | None:
        process = self._processes.get(rank)
        if process is not None and process.poll() is not None:
            return f"tensor-parallel rank {rank} exited ({_exit_status(process.returncode)})"
        limit = FIRST_BEAT_SECONDS if count <= 0 else HANG_SECONDS
        if silent > limit:
            return f"tensor-parallel rank {rank} stopped responding ({silent:.0f} s without a heartbeat)"
        return None

    def _fail(self, store: dist.TCPStore | None, reason: str) -> None:
        if self._stopped.is_set():
            return
        logger.error("%s; stopping every rank", reason)
        self.failure = reason
        for process in self._processes.values():
            if process.poll() is None:
                process.kill()
        if store is not None:
            try:
                store.set(ABORT_KEY, "1")
            except Exception:  # a best effort for ranks started elsewhere; ours are dead already
                logger.debug("could not tell the other ranks to abort", exc_info=True)


def _exit_status(code: int) -> str:
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit status {code}"
