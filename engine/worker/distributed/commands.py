"""What rank 0 tells the other ranks: a command and a few int64 vectors, in two broadcasts.

A fixed-size header (the command and each vector's length) goes first, then every vector in one flat int64
tensor. Against pickling the batch and broadcasting its size and bytes (what `broadcast_object_list` does),
measured with gloo on a busy 2-core machine (benchmarks/tensor_parallel.py --channel; 2 and 3 ranks; decode
steps of 8 and 64 sequences, a 2048-token prefill; three runs): 1.2-6.5 ms per step for the tensors against
3.2-12 ms pickled, slower in every case, and unpickling hands rank 0's objects to every rank. Shared memory
could skip the loopback copies, but would not reach a rank on another node; one code path serves both.
"""

from __future__ import annotations

import enum

import torch

from pagedserve.engine.worker.distributed.group import TensorParallelGroup

HEADER_SIZE = 16  # the command, the number of vectors, then up to 14 vector lengths
MAX_PARTS = HEADER_SIZE - 2


class Command(enum.IntEnum):
    STEP = 1  # run a packed batch (model_runner.pack_step)
    ALLOCATE = 2  # [num_blocks, block_size]: allocate the KV cache
    PROFILE = 3  # run the memory-profiling forward pass (kv_sizing)
    CAPTURE = 4  # [batch sizes], [max_seq_len]: record decode CUDA graphs
    STOP = 5  # leave the loop and exit


def send_command(group: TensorParallelGroup, command: Command, parts: list[torch.Tensor] | None = None) -> None:
    """Rank 0's side: `parts` are 1-D integer tensors on the host (empty ones too)."""
    parts = parts or []
    if len(parts) > MAX_PARTS:
        raise ValueError(f"a command carries at most {MAX_PARTS} vectors, got {len(parts)}")
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[0], header[1] = command, len(parts)
    header[2 : 2 + len(parts)] = torch.tensor([len(p) for p in parts], dtype=torch.int64)
    group.broadcast_host(header)
    if parts:
        group.broadcast_host(torch.cat([p.to(torch.int64) for p in parts]))


def receive_command(group: TensorParallelGroup) -> tuple[Command, list[torch.Tensor]]:
    """The other ranks' side: blocks until rank 0 sends the next command; the vectors come back as int64."""
    header = group.broadcast_host(torch.zeros(HEADER_SIZE, dtype=torch.int64)).tolist()
    command, count, sizes = Command(header[0]), header[1], header[2 : 2 + header[1]]
    if not count:
        return command, []
    flat = group.broadcast_host(torch.empty(sum(sizes), dtype=torch.int64))
    return command, list(flat.split(sizes))
