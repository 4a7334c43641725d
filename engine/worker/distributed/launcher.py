"""Rank 0's side of tensor parallelism: starts the other ranks, joins them, watches them, and stops them."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

from pagedserve.engine.child_python import module_command
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.distributed.commands import Command, send_command
from pagedserve.engine.worker.distributed.group import TensorParallelGroup
from pagedserve.engine.worker.distributed.liveness import RankLostError, RankMonitor
from pagedserve.engine.worker.distributed.rendezvous import (
    Rendezvous,
    join_group,
    launched_from_outside,
    open_master_store,
    rank_device,
)
from pagedserve.engine.worker.model_impl import check_fallback_splits
from pagedserve.engine.worker.models import ModelSpec
from pagedserve.engine.worker.weights.checkpoint import resolve_model_dir

logger = logging.getLogger(__name__)

CONFIG_KEY = "config"
LOG_LEVEL_KEY = "log_level"
STOP_SECONDS = 10.0  # for the ranks to leave their loop after STOP before they are killed


class TensorParallelWorkers:
    """Ranks 1..N-1 and rank 0's group with them. `start` returns once every rank has joined the group (they
    load their shards meanwhile); `stop` ends them all, on every path."""

    def __init__(self, monitor: RankMonitor, processes: dict[int, subprocess.Popen], store: dist.TCPStore) -> None:
        self.monitor = monitor
        self.processes = processes
        self._store = store  # rank 0 serves the store: it must live as long as the group
        self.group: TensorParallelGroup | None = None
        # Ends the ranks we started whatever happens to this object: collected, or the interpreter exiting.
        self._finalizer = weakref.finalize(self, _kill, list(processes.values()))

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> TensorParallelWorkers:
        """Checks the model splits over `config.tensor_parallel_size` ranks, starts them and joins them."""
        size = config.tensor_parallel_size
        model_dir = resolve_model_dir(config.model, config.revision)  # a GGUF is converted once, here
        hf_config = AutoConfig.from_pretrained(model_dir)
        check_fallback_splits(config, hf_config)
        ModelSpec.from_hf_config(hf_config).check_tensor_parallel(size)
        outside = Rendezvous.from_env() if launched_from_outside() else None
        if outside is not None and outside.world_size != size:
            raise ValueError(f"WORLD_SIZE {outside.world_size} != tensor_parallel_size {size}")
        store, rendezvous = open_master_store(size)
        store.set(CONFIG_KEY, pickle.dumps(_config_for_ranks(config, model_dir)).hex())
        store.set(LOG_LEVEL_KEY, str(logging.getLogger().getEffectiveLevel()))
        processes = {} if outside is not None else {r: _spawn(rendezvous, r) for r in range(1, size)}
        monitor = RankMonitor(rendezvous, processes)
        monitor.start()
        workers = cls(monitor, processes, store)
        try:
            workers.group = join_group(store, 0, size, rank_device(device), monitor.check)
        except BaseException:
            workers.stop()
            raise
        logger.info("tensor parallelism over %d ranks (rendezvous %s:%d)", size, rendezvous.host, rendezvous.port)
        return workers

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """Every rank allocates its KV cache: as many blocks as rank 0's, each holding that rank's heads."""
        send_command(self._group(), Command.ALLOCATE, [torch.tensor([num_blocks, block_size])])

    def capture(self, batch_sizes: list[int], max_seq_len: int) -> None:
        """Every rank records its decode graphs with rank 0 (their collectives are recorded in them)."""
        send_command(self._group(), Command.CAPTURE, [torch.tensor(batch_sizes), torch.tensor([max_seq_len])])

    def _group(self) -> TensorParallelGroup:
        assert self.group is not None, "start() first"
        return self.group

    def check(self) -> None:
        """Raises RankLostError once a rank has died or hung."""
        self.monitor.check()

    def lost(self, error: BaseException) -> RankLostError:
        """The error to end the engine with after a collective raised `error`."""
        reason = self.monitor.wait_for_failure(timeout=2.0)
        return RankLostError(reason or f"a tensor-parallel collective failed: {error}")

    def stop(self) -> None:
        """Tells the ranks to stop, waits a little, kills what is left. Safe to call twice, and after a loss."""
        healthy = self.monitor.failure is None
        self.monitor.stop()
        if healthy and self.group is not None:
            with contextlib.suppress(Exception):  # a rank that died since: the kill below covers it
                send_command(self.group, Command.STOP)
        for process in self.processes.values():
            try:
                process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank (pid %d) did not stop; killing it", process.pid)
        self._finalizer()
        self.group = None


def threads_per_rank(config: EngineConfig, device: torch.device) -> int | None:
    """torch threads for each rank: the configured number, or on the CPU an equal share of the cores this
    process may use (N ranks each taking every core would fight over them)."""
    if config.num_threads or device.type != "cpu" or config.tensor_parallel_size == 1:
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)


def _config_for_ranks(config: EngineConfig, model_dir: Path) -> EngineConfig:
    """What the other ranks load: the model directory rank 0 resolved (never a second conversion)."""
    return config.replace(model=str(model_dir), revision=None)


def _spawn(rendezvous: Rendezvous, rank: int) -> subprocess.Popen:
    # `python -m`, like the core process: nothing re-imports the caller's main module.
    return subprocess.Popen(
        module_command("pagedserve.engine.worker.distributed.rank"),
        env={**os.environ, **rendezvous.env_for(rank)},
        stdin=subprocess.DEVNULL,
    )


def _kill(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGKILL)
    for process in processes:
        with contextlib.suppress(Exception):
            process.wait(5)
