"""CUDA graphs for decode-only steps.

A decode step runs one token per sequence through a dozen small kernels per layer; on a fast GPU launching
them costs more than the math. A CUDA graph records one forward per padded batch size and replays it as a
single launch.

A graph replays the kernels, pointers and launch grids it recorded, so:
- every input a step changes lives in one static buffer (`DecodeBuffers`) that is filled before each replay;
- what the attention backend plans on the host is fixed at capture: one query tile per sequence, and the
  flash-decoding split count planned for the longest context the engine allows. Kernels read each
  sequence's true length from `seq_lens`, so splits past a short sequence's end are empty and weigh zero.

A batch of n sequences replays the graph of the smallest captured size >= n. Padding rows decode token 0 at
position 0 over one key with slot -1: they write nothing to the cache and their outputs are dropped.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from pagedserve.engine.worker.batch import StepInputs
from pagedserve.engine.worker.models.causal_lm import CausalLM
from pagedserve.kernels import AttentionMetadata, KernelBackend

logger = logging.getLogger(__name__)

Forward = Callable[[], torch.Tensor]
Replay = Callable[[], None]
# Records `forward` once; returns its (static) output and a function that reruns it on the buffers' contents.
Capture = Callable[[Forward], tuple[torch.Tensor, Replay]]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, ... below max_num_seqs, then max_num_seqs itself."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return [*sizes, max_num_seqs]


def cuda_graph_capture() -> Capture:
    """Captures into real CUDA graphs that share one memory pool (capture the largest size first)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(forward: Forward) -> tuple[torch.Tensor, Replay]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
        return out, graph.replay

    return capture


def eager_capture(forward: Forward) -> tuple[torch.Tensor, Replay]:
    """Stands in for a graph where there is no GPU: reruns `forward` into the same output tensor.

    Like a real replay it sees only what `forward` closed over, so it proves that every step input reaches
    the model through the static buffers.
    """
    out = forward()

    def replay() -> None:
        out.copy_(forward())

    return out, replay


class DecodeBuffers:
    """Static device tensors holding a decode batch of up to `max_batch` sequences."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device, num_kv_groups: int = 1) -> None:
        """`num_kv_groups`: KV cache groups, each with a slot mapping and block tables of its own (kv_groups.py)."""
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((num_kv_groups, max_batch), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)  # one token each
        self.block_tables = torch.zeros(num_kv_groups, max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[2]

    def metadata(self, batch: int, block_size: int, planned_seq_len: int) -> list[AttentionMetadata]:
        """Each KV cache group's metadata over the first `batch` rows; the host lengths are what the backend plans
        the launch for."""
        return [
            AttentionMetadata(
                block_tables=tables[:batch],
                seq_lens=self.seq_lens[:batch],
                query_start_loc=self.query_start_loc[: batch + 1],
                slot_mapping=slots[:batch],
                block_size=block_size,
                query_lens_host=[1] * batch,
                seq_lens_host=[planned_seq_len] * batch,
            )
            for tables, slots in zip(self.block_tables, self.slot_mapping)
        ]

    def load(self, inputs: StepInputs, batch: int) -> None:
        """Copies a decode step of n <= batch sequences in; rows n..batch become padding."""
        n = len(inputs.input_ids)
        metadata = inputs.metadata
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        for group, group_metadata in enumerate(metadata.groups or [metadata]):
            self.slot_mapping[group, :n].copy_(group_metadata.slot_mapping, non_blocking=True)
            width = group_metadata.block_tables.shape[1]
            self.block_tables[group, :n, :width].copy_(group_metadata.block_tables, non_blocking=True)
        if n < batch:
            self.input_ids[n:batch].zero_()
            self.positions[n:batch].zero_()
            self.slot_mapping[:, n:batch].fill_(-1)
            self.seq_lens[n:batch].fill_(1)
            self.block_tables[:, n:batch, 0].zero_()


class DecodeGraphs:
    """One recorded forward per batch size, replayed for decode-only steps that fit; records on construction,
    largest size first so the smaller graphs reuse its memory."""

    @torch.inference_mode()
    def __init__(
        self,
        model: CausalLM,
        backend: KernelBackend,
        block_size: int,
        max_seq_len: int,
        batch_sizes: list[int],
        capture: Capture,
        device: torch.device,
        num_kv_groups: int = 1,
    ) -> None:
        start = time.perf_counter()
        self.buffers = DecodeBuffers(max(batch_sizes), -(-max_seq_len // block_size), device, num_kv_groups)
        self._graphs: dict[int, tuple[torch.Tensor, Replay]] = {}  # batch size -> (output, replay)
        for batch in sorted(set(batch_sizes), reverse=True):
            groups = [backend.prepare(m) for m in self.buffers.metadata(batch, block_size, max_seq_len)]
            metadata = groups[0]
            metadata.groups = groups if num_kv_groups > 1 else []
            forward = self._forward(model, batch, metadata)
            forward()  # warm-up: compiles the kernels and fills the step plan before anything is recorded
            self._graphs[batch] = capture(forward)
        self.batch_sizes = sorted(self._graphs)
        self.num_replays = 0
        logger.info(
            "captured decode graphs for batch sizes %s in %.1f s", self.batch_sizes, time.perf_counter() - start
        )

    def _forward(self, model: CausalLM, batch: int, metadata: AttentionMetadata) -> Forward:
        buffers = self.buffers
        return lambda: model(buffers.input_ids[:batch], buffers.positions[:batch], metadata)

    def can_run(self, inputs: StepInputs) -> bool:
        metadata = inputs.metadata
        return (
            metadata.is_decode_only
            and metadata.num_seqs <= self.batch_sizes[-1]
            and metadata.block_tables.shape[1] <= self.buffers.max_blocks_per_seq
        )

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode step that `can_run`."""
        n = len(inputs.input_ids)
        batch = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        self.buffers.load(inputs, batch)
        output, replay = self._graphs[batch]
        replay()
        self.num_replays += 1
        return output[:n]
