"""One rank's handle on the tensor-parallel ranks: the collectives the sharded layers and the step broadcast use."""

from __future__ import annotations

import time
from typing import Protocol

import torch
import torch.distributed as dist


class Collectives(Protocol):
    """What we call on a gloo or NCCL backend. They are built directly (rendezvous.py), not through
    init_process_group: no process-wide default group, so one process may hold several engines in turn."""

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], options: dist.GatherOptions
    ) -> dist.Work: ...

    def broadcast(self, tensors: list[torch.Tensor], options: dist.BroadcastOptions) -> dist.Work: ...


class TensorParallelGroup:
    """Rank `rank` of `size`. Two process groups: `cpu` (gloo) carries what lives on the host (each step's
    inputs, the commands), `device` (NCCL on CUDA, the gloo group itself on CPU) carries activations.

    `comm_seconds` adds up the time spent in activation collectives (host time: on CUDA it counts launches
    and waits, not the transfers the GPU overlaps)."""

    def __init__(self, rank: int, size: int, cpu: Collectives, device_group: Collectives, device: torch.device) -> None:
        self.rank = rank
        self.size = size
        self.cpu = cpu
        self.device_group = device_group
        self.device = device
        self.comm_seconds = 0.0

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks in place; x may be the transposed view the CPU backend's linear returns."""
        start = time.perf_counter()
        if x.is_contiguous():
            storage = x
        elif x.dim() == 2 and x.t().is_contiguous():
            storage = x.t()  # the same memory, contiguous: reducing it reduces x
        else:
            x = storage = x.contiguous()
        self.device_group.allreduce([storage]).wait()
        self.comm_seconds += time.perf_counter() - start
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: the ranks' x [R, C] side by side, [R, size * C]. Other ranks: x itself (they only send)."""
        start = time.perf_counter()
        x = x.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.is_first:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.device_group.gather([parts], [x], options).wait()
            x = torch.cat(parts, dim=-1)
        else:
            self.device_group.gather([], [x], options).wait()
        self.comm_seconds += time.perf_counter() - start
        return x

    def broadcast_host(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's host tensor x, copied into x on every other rank (same shape and dtype everywhere)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.cpu.broadcast([x], options).wait()
        return x
