"""What a step hands the worker and what it gets back: the scheduled sequences as the runner reads them
(protocols the core's scheduler output satisfies, so the worker never imports the core), their block tables,
and the packed inputs and logits of one step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pagedserve.engine.outputs import TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.kernels import AttentionMetadata


class SequenceState(Protocol):
    """The parts of a sequence (engine/scheduling's Request) that packing and prompt scoring read."""

    @property
    def request_id(self) -> str: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def prompt_logprobs(self) -> Sequence[TokenLogprob]: ...


class ScheduledSequence(Protocol):
    """One sequence of a step: its state and how many of its tokens this step computes."""

    @property
    def request(self) -> SequenceState: ...
    @property
    def num_new_tokens(self) -> int: ...
    @property
    def draft_token_ids(self) -> Sequence[int]: ...  # proposed tokens after its known ones, verified this step
    @property
    def samples(self) -> bool: ...


class BlockTables(Protocol):
    """Where each sequence's KV lives (engine/scheduling's KVCacheManager)."""

    @property
    def block_size(self) -> int: ...
    def block_ids(self, request_id: str) -> list[int]: ...


class GroupedBlockTables(BlockTables, Protocol):
    """Block tables of several KV cache groups (engine/scheduling's HybridKVCacheManager, kv_groups.py)."""

    @property
    def num_groups(self) -> int: ...
    def block_ids_by_group(self, request_id: str) -> list[list[int]]: ...


@dataclass
class PromptRows:
    """The rows of one request's hidden states to score this step, and the prompt tokens they predict."""

    request_id: str
    rows: torch.Tensor  # [m] indices into the step's flat hidden states
    targets: torch.Tensor  # [m] token ids
    top_k: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [R] rows of each sampling request's last token (and of its proposed ones)
    prompt_rows: list[PromptRows] = field(default_factory=list)  # rows whose prompt logprobs were asked for


@dataclass
class StepLogits:
    # [R, vocab] float32: per scheduled request that samples, one row, or 1 + k with k proposed tokens
    sampling: torch.Tensor
    prompt_logprobs: dict[str, list[TokenLogprob]]  # new prompt logprobs by sequence id


@dataclass
class HostBatch:
    """One step's packed inputs on the host, before they move to the device: what rank 0 broadcasts."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, or [G, T] with G > 1 KV cache groups
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32, or [G, S, max_blocks]
    logits_indices: torch.Tensor  # [R] int64
    query_lens_host: list[int]
    seq_lens_host: list[int]

    def parts(self) -> list[torch.Tensor]:
        return [
            self.input_ids,
            self.positions,
            self.slot_mapping.flatten(),
            self.seq_lens,
            self.query_start_loc,
            self.block_tables.flatten(),
            self.logits_indices,
        ]

    @classmethod
    def from_parts(cls, parts: list[torch.Tensor]) -> HostBatch:
        """The inverse of parts() (which arrive as int64)."""
        input_ids, positions, slot_mapping, seq_lens, query_start_loc, block_tables, logits_indices = parts
        num_seqs = len(seq_lens)
        num_groups = len(slot_mapping) // max(1, len(input_ids))
        grouped = (num_groups, num_seqs, -1) if num_groups > 1 else (num_seqs, -1)
        return cls(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping.view(num_groups, -1) if num_groups > 1 else slot_mapping,
            seq_lens=seq_lens.to(torch.int32),
            query_start_loc=query_start_loc.to(torch.int32),
            block_tables=block_tables.to(torch.int32).view(grouped),
            logits_indices=logits_indices,
            query_lens_host=query_start_loc.diff().tolist(),
            seq_lens_host=seq_lens.tolist(),
        )


def num_proposed_rows(batch: HostBatch) -> int:
    """Sampling rows that are proposed tokens: each verifying sequence's rows but its first (its last known token,
    whose row plain decoding has too). A sequence's rows are consecutive, so they are the rows whose sequence is
    the previous row's."""
    rows = batch.logits_indices
    if len(rows) <= 1:
        return 0
    seq = torch.searchsorted(batch.query_start_loc[1:].to(rows.dtype), rows, right=True)
    return int((seq[1:] == seq[:-1]).sum())


NUM_BATCH_PARTS = 7  # HostBatch.parts(); a step command adds the prompt rows and the block copies
