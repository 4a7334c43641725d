"""ModelExecutor: the worker side as the engine core sees it, one object and one call a step.

It loads the model (whole, or split over tensor-parallel ranks it starts), sizes the KV cache from what the
model leaves of the memory budget, allocates the cache once the core's block manager exists, records CUDA
graphs where they apply, and runs each step's scheduled sequences. The core never reaches past it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from pagedserve.engine import openmp_policy
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.batch import BlockTables, ScheduledSequence, StepLogits
from pagedserve.engine.worker.cuda_graphs import cuda_graph_capture, graph_batch_sizes
from pagedserve.engine.worker.distributed.launcher import TensorParallelWorkers, threads_per_rank
from pagedserve.engine.worker.distributed.liveness import RankLostError
from pagedserve.engine.worker.kernel_layouts import use_activations
from pagedserve.engine.worker.kv_caches import allocate_kv_caches
from pagedserve.engine.worker.kv_groups import model_kv_groups
from pagedserve.engine.worker.kv_sizing import KVCachePlan, plan_kv_cache
from pagedserve.engine.worker.loaded_model import LoadedModel
from pagedserve.engine.worker.model_loader import load_model, resolve_device
from pagedserve.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class ModelExecutor:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """With tensor_parallel_size N > 1 this is rank 0: it starts ranks 1..N-1, which close() ends. A failed
        start ends them too, and reports a rank's death rather than the collective that failed after it."""
        self.config = config
        self.workers: TensorParallelWorkers | None = None
        self._runner: ModelRunner | None = None
        if config.tensor_parallel_size > 1:
            if loaded is not None:
                raise ValueError("a model loaded in this process cannot be split: use tensor_parallel_size 1")
            self.workers = TensorParallelWorkers.start(config, resolve_device(config.device))
        try:
            self.loaded = loaded or self._load()
            use_activations(self.loaded, config.activation_dtype)
            openmp_policy.warn_if_set_too_late(self.loaded.device.type)
            threads = threads_per_rank(config, self.loaded.device)
            if threads:
                torch.set_num_threads(threads)
            self.kv_plan: KVCachePlan = plan_kv_cache(config, self.loaded)
        except BaseException as exc:
            raise self._failed_start(exc) from exc

    def _load(self) -> LoadedModel:
        workers = self.workers
        return load_model(self.config) if workers is None else load_model(self.config, workers.group, workers.check)

    def _failed_start(self, exc: BaseException) -> BaseException:
        lost = None if self.workers is None else self.workers.monitor.failure
        self.close()
        return exc if lost is None else RankLostError(lost)

    def bind_kv_cache(self, block_tables: BlockTables) -> None:
        """Allocates every rank's KV cache as planned; `block_tables` (the core's block manager) says where each
        sequence's tokens live."""
        plan, loaded = self.kv_plan, self.loaded
        try:
            if self.workers is not None:
                self.workers.allocate(plan.num_blocks, plan.block_size)
            caches = allocate_kv_caches(
                loaded.rank_spec,
                plan.num_blocks,
                plan.block_size,
                loaded.dtype,
                loaded.device,
                model_kv_groups(loaded.model),
            )
            self._runner = ModelRunner(loaded.model, loaded.backend, block_tables, caches, loaded.device)
            if self._use_cuda_graphs():
                sizes = graph_batch_sizes(self.config.max_num_seqs)
                if self.workers is not None:
                    self.workers.capture(sizes, plan.max_model_len)
                self._runner.capture_decode_graphs(sizes, plan.max_model_len, cuda_graph_capture())
        except BaseException as exc:
            raise self._failed_start(exc) from exc

    def _use_cuda_graphs(self) -> bool:
        if self.loaded.device.type != "cuda" or self.config.enforce_eager:
            return False
        if not getattr(self.loaded.model, "records_in_cuda_graphs", True):
            logger.info("CUDA graphs off: %s's layers cannot be recorded", self.loaded.spec.architecture)
            return False
        if not self.loaded.backend.supports_cuda_graphs:
            logger.info("CUDA graphs off: the %s attention backend cannot be recorded", self.loaded.backend.name)
            return False
        return True

    @property
    def runner(self) -> ModelRunner:
        assert self._runner is not None, "bind_kv_cache() first"
        return self._runner

    def execute(self, scheduled: Sequence[ScheduledSequence], copies: list[tuple[int, int]]) -> StepLogits:
        """Logits of the sequences that sample this step, and the prompt logprobs asked for. Split over ranks, a
        failure may leave them out of step: then it is a lost rank, and nothing more can run."""
        try:
            return self.runner.execute(scheduled, copies)
        except Exception as exc:
            if self.workers is not None:
                raise self.workers.lost(exc) from exc
            raise

    @property
    def communication_seconds(self) -> float:
        """Rank 0's time in tensor-parallel collectives so far."""
        return 0.0 if self.loaded.group is None else self.loaded.group.comm_seconds

    def reset_clocks(self) -> None:
        self.runner.forward_seconds = 0.0
        if self.loaded.group is not None:
            self.loaded.group.comm_seconds = 0.0

    def check_health(self) -> None:
        """Raises RankLostError once a tensor-parallel rank has died or hung (nothing to check otherwise)."""
        if self.workers is not None:
            self.workers.check()

    @property
    def has_ranks(self) -> bool:
        return self.workers is not None

    def close(self) -> None:
        """Ends the tensor-parallel ranks (nothing else holds resources beyond this object)."""
        if self.workers is not None:
            self.workers.stop()
            self.workers = None
