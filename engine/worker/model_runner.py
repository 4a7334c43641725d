"""Packs one step's scheduled tokens into a flat batch, runs the model, returns the logits to sample.

`ShardRunner` runs a packed batch on one rank's part of the model; `ModelRunner`, on rank 0 (or alone), packs
the batch from the scheduler's output, and when the model is split over ranks first broadcasts it to them.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator, Sequence
from typing import cast

import torch
import torch.nn.functional as F

from pagedserve.engine.worker.batch import (
    NUM_BATCH_PARTS,
    BlockTables,
    GroupedBlockTables,
    HostBatch,
    ScheduledSequence,
    SequenceState,
    StepInputs,
    StepLogits,
    num_proposed_rows,
)
from pagedserve.engine.worker.cuda_graphs import Capture, DecodeGraphs
from pagedserve.engine.worker.distributed.commands import Command, send_command
from pagedserve.engine.worker.kv_groups import model_kv_groups
from pagedserve.engine.worker.models import KVCache
from pagedserve.engine.worker.models.causal_lm import CausalLM
from pagedserve.engine.worker.models.partial_rope import PartialRotaryEmbedding
from pagedserve.engine.worker.native_decoder import bind_kv_caches
from pagedserve.engine.worker.prompt_logprobs import PromptRows, lm_head_chunks, rows_to_score, score
from pagedserve.kernels import AttentionMetadata, KernelBackend


class ShardRunner:
    """Runs packed batches on the model this process holds (all of it, or one rank's part)."""

    def __init__(
        self,
        model: CausalLM,
        backend: KernelBackend,
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.kv_caches = kv_caches
        bind_kv_caches(model, kv_caches)
        # Several KV cache groups where the layers share the cache's tensors (kv_groups.py), else one.
        groups = model_kv_groups(model)
        shared = len({id(k_cache) for k_cache, _ in kv_caches}) < len(kv_caches)
        self.num_kv_groups = groups.num_groups if groups is not None and shared else 1
        self.decode_graphs: DecodeGraphs | None = None
        self.forward_seconds = 0.0  # time inside the model, for the overhead figures
        self.num_tokens_processed = 0

    def capture_decode_graphs(self, batch_sizes: list[int], max_seq_len: int, capture: Capture) -> None:
        """From now on decode-only steps of up to max(batch_sizes) sequences replay recorded graphs."""
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.backend,
            self.block_size,
            max_seq_len,
            batch_sizes,
            capture,
            self.device,
            self.num_kv_groups,
        )

    def to_inputs(self, batch: HostBatch, prompt_rows: list[PromptRows] | None = None) -> StepInputs:
        def to_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device, non_blocking=True)

        seq_lens, query_start_loc = to_device(batch.seq_lens), to_device(batch.query_start_loc)

        def metadata(block_tables: torch.Tensor, slot_mapping: torch.Tensor) -> AttentionMetadata:
            return self.backend.prepare(
                AttentionMetadata(
                    block_tables=to_device(block_tables),
                    seq_lens=seq_lens,
                    query_start_loc=query_start_loc,
                    slot_mapping=to_device(slot_mapping),
                    block_size=self.block_size,
                    query_lens_host=batch.query_lens_host,
                    seq_lens_host=batch.seq_lens_host,
                )
            )

        if batch.block_tables.dim() == 3:  # one table and slot mapping per KV cache group
            groups = [metadata(tables, slots) for tables, slots in zip(batch.block_tables, batch.slot_mapping)]
            step_metadata = groups[0]
            step_metadata.groups = groups
        else:
            step_metadata = metadata(batch.block_tables, batch.slot_mapping)
        return StepInputs(
            input_ids=to_device(batch.input_ids),
            positions=to_device(batch.positions),
            metadata=step_metadata,
            logits_indices=to_device(batch.logits_indices),
            prompt_rows=prompt_rows or [],
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of blocks shared by parallel samples, in every layer's cache."""
        source = torch.tensor([s for s, _ in copies], device=self.device)
        destination = torch.tensor([d for _, d in copies], device=self.device)
        distinct = {id(k_cache): (k_cache, v_cache) for k_cache, v_cache in self.kv_caches}  # groups share them
        for k_cache, v_cache in distinct.values():
            k_cache.index_copy_(0, destination, k_cache.index_select(0, source))
            v_cache.index_copy_(0, destination, v_cache.index_select(0, source))

    @contextlib.contextmanager
    def proposals_counted(self, batch: HostBatch) -> Iterator[None]:
        """The step's proposed rows told to the backend for its forward and sampling head (not for prompt rows
        scored after them): a verifying step chooses its activations as plain decoding's would."""
        self.backend.proposed_rows = num_proposed_rows(batch)
        try:
            yield
        finally:
            self.backend.proposed_rows = 0

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        if self.decode_graphs is not None and self.decode_graphs.can_run(inputs):
            return self.decode_graphs.run(inputs)
        return self.model(inputs.input_ids, inputs.positions, inputs.metadata)

    @torch.inference_mode()
    def follow(self, parts: list[torch.Tensor]) -> None:
        """Another rank's side of rank 0's `execute`: the same forward, and the same LM head passes (score's
        chunks of prompt rows included), whose logits only rank 0 receives."""
        batch = HostBatch.from_parts(parts[:NUM_BATCH_PARTS])
        prompt_rows, copies = parts[NUM_BATCH_PARTS:]
        if len(copies):
            self.copy_blocks([(source, destination) for source, destination in copies.view(-1, 2).tolist()])
        inputs = self.to_inputs(batch)
        start = time.perf_counter()
        with self.proposals_counted(batch):
            hidden = self.forward(inputs)
            self.model.compute_logits(hidden[inputs.logits_indices])
        for part in lm_head_chunks(len(prompt_rows), self.device):
            self.model.compute_logits(hidden[prompt_rows[part].to(self.device)])
        self.forward_seconds += time.perf_counter() - start
        self.num_tokens_processed += len(inputs.input_ids)


class ModelRunner(ShardRunner):
    """Rank 0's runner (or the only one): packs the scheduled requests, and runs them with every rank."""

    def __init__(
        self,
        model: CausalLM,
        backend: KernelBackend,
        kv_manager: BlockTables,
        kv_caches: list[KVCache],
        device: torch.device,
    ) -> None:
        super().__init__(model, backend, kv_caches, kv_manager.block_size, device)
        self.kv = kv_manager
        self.group = model.group
        assert getattr(kv_manager, "num_groups", 1) == self.num_kv_groups, "the block manager's groups are the cache's"

    def pack(self, scheduled: Sequence[ScheduledSequence]) -> HostBatch:
        """Flat inputs for all scheduled requests."""
        decode = all(s.num_new_tokens == 1 and not s.draft_token_ids for s in scheduled)
        if scheduled and decode and self.num_kv_groups == 1:
            return self._pack_decode(scheduled)
        return self._pack_any(scheduled)

    def _pack_any(self, scheduled: Sequence[ScheduledSequence]) -> HostBatch:
        """pack() for any step: vectorised over tokens, a loop only over requests."""
        requests = [s.request for s in scheduled]
        num_new = [s.num_new_tokens for s in scheduled]
        computed = [r.num_computed_tokens for r in requests]
        token_ids = list(itertools.chain.from_iterable(_step_tokens(s, c) for s, c in zip(scheduled, computed)))
        query_lens = torch.tensor(num_new)
        query_start_loc = torch.zeros(len(scheduled) + 1, dtype=torch.int32)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        seq_of_token = torch.repeat_interleave(torch.arange(len(scheduled)), query_lens)
        positions = torch.arange(len(token_ids)) - (query_start_loc[:-1] - torch.tensor(computed))[seq_of_token]
        block_tables = self._tables_of(requests)
        block_of_token = block_tables[..., seq_of_token, positions // self.block_size].long()  # [T] or [G, T]
        seq_lens = [c + n for c, n in zip(computed, num_new)]
        known = torch.tensor([len(r.all_token_ids) for r in requests])[seq_of_token]
        return HostBatch(
            input_ids=torch.tensor(token_ids),
            positions=self._rotary_rows(positions, known),
            slot_mapping=block_of_token * self.block_size + positions % self.block_size,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=query_start_loc,
            block_tables=block_tables,
            logits_indices=_sampling_rows(scheduled, query_start_loc),
            query_lens_host=num_new,
            seq_lens_host=seq_lens,
        )

    def _pack_decode(self, scheduled: Sequence[ScheduledSequence]) -> HostBatch:
        """pack() for a step of one new token a request (decode): plain lists over the requests, then one tensor
        a field. The general path's twenty-odd small tensor ops cost ~1 ms, a tenth of a one-sequence step."""
        requests = [s.request for s in scheduled]
        positions = [r.num_computed_tokens for r in requests]
        tables = [self.kv.block_ids(r.request_id) for r in requests]
        width = max(map(len, tables))
        size = self.block_size
        seq_lens = [position + 1 for position in positions]
        return HostBatch(
            input_ids=torch.tensor([r.all_token_ids[p] for r, p in zip(requests, positions)]),
            positions=self._rotary_rows(
                torch.tensor(positions), torch.tensor([len(r.all_token_ids) for r in requests])
            ),
            slot_mapping=torch.tensor([t[p // size] * size + p % size for t, p in zip(tables, positions)]),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.arange(len(scheduled) + 1, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            logits_indices=torch.tensor([i for i, s in enumerate(scheduled) if s.samples], dtype=torch.int64),
            query_lens_host=[1] * len(scheduled),
            seq_lens_host=seq_lens,
        )

    def _rotary_rows(self, positions: torch.Tensor, sequence_lens: torch.Tensor) -> torch.Tensor:
        """The rows of the RoPE tables the model reads: LongRoPE's depend on the length of each token's
        sequence too (models/partial_rope.py); the KV slots were placed by the true positions."""
        rotary = getattr(self.model, "rotary", None)
        if isinstance(rotary, PartialRotaryEmbedding):
            return rotary.table_rows(positions, sequence_lens)
        return positions

    def prepare(self, scheduled: Sequence[ScheduledSequence]) -> StepInputs:
        batch = self.pack(scheduled)
        return self.to_inputs(batch, rows_to_score(scheduled, batch.query_start_loc))

    def _tables_of(self, requests: Sequence[SequenceState]) -> torch.Tensor:
        """The requests' block tables [S, max_blocks], or [G, S, max_blocks] with G > 1 KV cache groups."""
        if self.num_kv_groups == 1:
            return self._block_tables([self.kv.block_ids(r.request_id) for r in requests])
        kv = cast(GroupedBlockTables, self.kv)
        by_request = [kv.block_ids_by_group(r.request_id) for r in requests]
        tables = [self._block_tables([groups[g] for groups in by_request]) for g in range(self.num_kv_groups)]
        width = max(t.shape[1] for t in tables)
        return torch.stack([F.pad(t, (0, width - t.shape[1])) for t in tables])

    @staticmethod
    def _block_tables(tables: list[list[int]]) -> torch.Tensor:
        lengths = torch.tensor([len(t) for t in tables])
        out = torch.zeros(len(tables), max(1, int(lengths.max())), dtype=torch.int32)
        rows = torch.repeat_interleave(torch.arange(len(tables)), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        cols = torch.arange(int(lengths.sum())) - starts[rows]
        out[rows, cols] = torch.tensor(list(itertools.chain.from_iterable(tables)), dtype=torch.int32)
        return out

    @torch.inference_mode()
    def execute(
        self, scheduled: Sequence[ScheduledSequence], copies: list[tuple[int, int]] | None = None
    ) -> StepLogits:
        """Logits for the scheduled requests that sample this step, and the prompt logprobs asked for."""
        batch = self.pack(scheduled)
        prompt_rows = rows_to_score(scheduled, batch.query_start_loc)
        if self.group is not None:
            send_command(self.group, Command.STEP, _step_parts(batch, prompt_rows, copies or []))
        if copies:
            self.copy_blocks(copies)
        inputs = self.to_inputs(batch, prompt_rows)
        start = time.perf_counter()
        with self.proposals_counted(batch):
            hidden = self.forward(inputs)
            logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        prompt = score(self.model.compute_logits, hidden, inputs.prompt_rows) if inputs.prompt_rows else {}
        self.forward_seconds += time.perf_counter() - start
        self.num_tokens_processed += len(inputs.input_ids)
        return StepLogits(logits, prompt)


def _step_tokens(item: ScheduledSequence, computed: int) -> list[int]:
    """The tokens a sequence computes this step: its next known ones, then the proposed ones."""
    known = item.request.all_token_ids[computed : computed + item.num_new_tokens]
    return known + list(item.draft_token_ids) if item.draft_token_ids else known


def _sampling_rows(scheduled: Sequence[ScheduledSequence], query_start_loc: torch.Tensor) -> torch.Tensor:
    """The rows through the LM head: each sampling sequence's last known token and its proposed ones."""
    sampling = [s.samples for s in scheduled]
    num_rows = torch.tensor([1 + len(s.draft_token_ids) for s, x in zip(scheduled, sampling) if x])
    ends = query_start_loc[1:][sampling].long()
    if int(num_rows.sum()) == len(num_rows):
        return ends - 1
    seq = torch.repeat_interleave(torch.arange(len(num_rows)), num_rows)
    offsets = torch.arange(len(seq)) - (torch.cumsum(num_rows, 0) - num_rows)[seq]
    return ends[seq] - num_rows[seq] + offsets


def _step_parts(batch: HostBatch, prompt_rows: list[PromptRows], copies: list[tuple[int, int]]) -> list[torch.Tensor]:
    """What the other ranks need of a step: the batch, the rows score() passes through the LM head (in its
    order), and the blocks to copy first."""
    rows = torch.cat([p.rows for p in prompt_rows]) if prompt_rows else torch.empty(0, dtype=torch.int64)
    return [*batch.parts(), rows, torch.tensor(copies, dtype=torch.int64).flatten()]
