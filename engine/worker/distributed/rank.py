"""`python -m pagedserve.engine.worker.distributed.rank`: one tensor-parallel rank other than 0.

Rank 0 starts these on its own host; under an outside launcher (torchrun, one pod per rank) every rank but 0
runs this module with MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK set. The rank reads the engine config
from rank 0's store, loads its slices of the model, then runs what rank 0 broadcasts until STOP.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys

import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.cuda_graphs import cuda_graph_capture
from pagedserve.engine.worker.distributed.commands import Command, receive_command
from pagedserve.engine.worker.distributed.group import TensorParallelGroup
from pagedserve.engine.worker.distributed.launcher import CONFIG_KEY, LOG_LEVEL_KEY, threads_per_rank
from pagedserve.engine.worker.distributed.liveness import start_heartbeat
from pagedserve.engine.worker.distributed.rendezvous import Rendezvous, connect_store, join_group, rank_device
from pagedserve.engine.worker.kernel_layouts import use_activations
from pagedserve.engine.worker.kv_caches import allocate_kv_caches
from pagedserve.engine.worker.kv_groups import model_kv_groups
from pagedserve.engine.worker.model_loader import LoadedModel, load_model, resolve_device
from pagedserve.engine.worker.model_runner import ShardRunner

logger = logging.getLogger(__name__)


class Follower:
    """Runs rank 0's commands on this rank's part of the model."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, group: TensorParallelGroup) -> None:
        self.config = config
        self.loaded = loaded
        use_activations(loaded, config.activation_dtype)
        self.group = group
        self.runner: ShardRunner | None = None

    def serve(self) -> None:
        while True:
            command, parts = receive_command(self.group)
            if command is Command.STOP:
                return
            if command is Command.STEP:
                assert self.runner is not None, "rank 0 allocates the KV cache before the first step"
                self.runner.follow(parts)
            elif command is Command.ALLOCATE:
                self._allocate(*parts[0].tolist())
            elif command is Command.PROFILE:
                self._profile()
            elif command is Command.CAPTURE:
                assert self.runner is not None
                self.runner.capture_decode_graphs(parts[0].tolist(), int(parts[1][0]), cuda_graph_capture())

    def _allocate(self, num_blocks: int, block_size: int) -> None:
        loaded = self.loaded
        caches = allocate_kv_caches(
            loaded.rank_spec, num_blocks, block_size, loaded.dtype, loaded.device, model_kv_groups(loaded.model)
        )
        self.runner = ShardRunner(loaded.model, loaded.backend, caches, block_size, loaded.device)

    def _profile(self) -> None:
        from pagedserve.engine.worker.kv_sizing import rank_view
        from pagedserve.engine.worker.profiling import profile_forward_peak

        profile_forward_peak(rank_view(self.loaded), self.config)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 decides, not us
    rendezvous = Rendezvous.from_env()
    if rendezvous is None or "RANK" not in os.environ:
        sys.exit("a tensor-parallel rank needs MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK")
    rank = int(os.environ["RANK"])
    store = connect_store(rendezvous)
    level = int(store.get(LOG_LEVEL_KEY).decode())
    logging.basicConfig(level=level, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    start_heartbeat(rendezvous, rank)
    config: EngineConfig = pickle.loads(bytes.fromhex(store.get(CONFIG_KEY).decode()))
    device = rank_device(resolve_device(config.device))
    threads = threads_per_rank(config, device)
    if threads:
        torch.set_num_threads(threads)
    group = join_group(store, rank, rendezvous.world_size, device)
    try:
        Follower(config, load_model(config, group), group).serve()
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)  # skips the group's teardown, which could wait on the ranks that are gone
    os._exit(0)


if __name__ == "__main__":
    main()
