"""Where the ranks meet: a TCPStore on rank 0, then one gloo group (and an NCCL one on CUDA) over it.

Started by rank 0 on one host, the store listens on a free loopback port that rank 0 hands to the ranks it
starts. Under an outside launcher (torchrun, a Kubernetes StatefulSet) every rank reads the torchrun-style
variables MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK instead, and rank 0 listens on MASTER_PORT.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from pagedserve.engine.worker.distributed.group import Collectives, TensorParallelGroup

# How long a store read waits, and a collective before gloo gives up. Liveness (liveness.py) notices dead and
# hung ranks much sooner; these only bound what it cannot see.
STORE_TIMEOUT = datetime.timedelta(minutes=10)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
JOIN_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class Rendezvous:
    host: str
    port: int
    world_size: int

    @classmethod
    def from_env(cls) -> Rendezvous | None:
        """The torchrun-style variables, when MASTER_ADDR, MASTER_PORT and WORLD_SIZE are all set."""
        names = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
        if not all(os.environ.get(name) for name in names):
            return None
        return cls(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]))

    def env_for(self, rank: int) -> dict[str, str]:
        """The variables a rank started by rank 0 reads (`rank.py`)."""
        return {
            "MASTER_ADDR": self.host,
            "MASTER_PORT": str(self.port),
            "WORLD_SIZE": str(self.world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
        }


def launched_from_outside() -> bool:
    """Whether an outside launcher started every rank (RANK is set): rank 0 then starts none itself."""
    return Rendezvous.from_env() is not None and "RANK" in os.environ


def open_master_store(world_size: int) -> tuple[dist.TCPStore, Rendezvous]:
    """Rank 0's store: on MASTER_ADDR:MASTER_PORT under an outside launcher, else on a free loopback port."""
    configured = Rendezvous.from_env() if launched_from_outside() else None
    host, port = (configured.host, configured.port) if configured else ("127.0.0.1", 0)
    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    return store, Rendezvous(host, store.port, world_size)


def connect_store(rendezvous: Rendezvous) -> dist.TCPStore:
    return dist.TCPStore(
        rendezvous.host, rendezvous.port, rendezvous.world_size, is_master=False, timeout=STORE_TIMEOUT
    )


def rank_device(device: torch.device) -> torch.device:
    """The device a rank runs on: its own GPU (LOCAL_RANK) on CUDA, the CPU otherwise."""
    if device.type != "cuda":
        return device
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def join_group(
    store: dist.TCPStore, rank: int, size: int, device: torch.device, healthy: Callable[[], None] = lambda: None
) -> TensorParallelGroup:
    """Every rank calls this once. Rank 0 first waits, calling `healthy` (which raises on a dead rank), until
    every rank has said it is joining, so that a rank that died before ever joining is noticed at once rather
    than after the store's timeout."""
    store.set(f"joining/{rank}", "1")
    if rank == 0:
        keys = [f"joining/{r}" for r in range(size)]
        while not store.check(keys):
            healthy()
            time.sleep(JOIN_POLL_SECONDS)
    cpu = cast(Collectives, dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, size, COLLECTIVE_TIMEOUT))
    device_group = cpu
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        device_group = cast(Collectives, dist.ProcessGroupNCCL(dist.PrefixStore("device", store), rank, size, options))
    return TensorParallelGroup(rank, size, cpu, device_group, device)
