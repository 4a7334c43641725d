"""Packs one step's scheduled tokens into a flat batch, runs the model, returns the logits to sample."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from pagedserve.engine.cuda_graphs import Capture, DecodeGraphs
from pagedserve.engine.kv_cache_manager import KVCacheManager
from pagedserve.engine.kv_sizing import kv_cache_shape
from pagedserve.engine.models import KVCache, LlamaForCausalLM, ModelSpec
from pagedserve.engine.outputs import TokenLogprob
from pagedserve.engine.prompt_logprobs import PromptRows, rows_to_score, score
from pagedserve.engine.scheduler import ScheduledRequest
from pagedserve.kernels import AttentionMetadata, KernelBackend


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [R] rows of the last token of each sampling request
    prompt_rows: list[PromptRows] = field(default_factory=list)  # rows whose prompt logprobs were asked for


@dataclass
class StepLogits:
    sampling: torch.Tensor  # [R, vocab] float32, one row per scheduled request that samples
    prompt_logprobs: dict[str, list[TokenLogprob]]  # new prompt logprobs by sequence id


def allocate_kv_caches(
    spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[KVCache]:
    """Zeroed K and V caches of every layer, in the layout kv_sizing counts bytes for."""
    shape = kv_cache_shape(spec, num_blocks, block_size)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(spec.num_layers)
    ]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: KernelBackend,
        kv_manager: KVCacheManager,
        kv_caches: list[KVCache],
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv = kv_manager
        self.block_size = kv_manager.block_size
        self.device = device
        self.kv_caches = kv_caches
        model.bind_kv_caches(kv_caches)
        self.decode_graphs: DecodeGraphs | None = None
        self.forward_seconds = 0.0  # time inside the model, for the overhead figures
        self.num_tokens_processed = 0

    def capture_decode_graphs(self, batch_sizes: list[int], max_seq_len: int, capture: Capture) -> None:
        """From now on decode-only steps of up to max(batch_sizes) sequences replay recorded graphs."""
        self.decode_graphs = DecodeGraphs(
            self.model, self.backend, self.block_size, max_seq_len, batch_sizes, capture, self.device
        )

    def prepare(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        """Flat inputs for all scheduled requests; vectorised over tokens, a loop only over requests."""
        requests = [s.request for s in scheduled]
        num_new = [s.num_new_tokens for s in scheduled]
        computed = [r.num_computed_tokens for r in requests]
        token_ids = list(
            itertools.chain.from_iterable(r.all_token_ids[c : c + n] for r, c, n in zip(requests, computed, num_new))
        )
        query_lens = torch.tensor(num_new)
        query_start_loc = torch.zeros(len(scheduled) + 1, dtype=torch.int32)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        seq_of_token = torch.repeat_interleave(torch.arange(len(scheduled)), query_lens)
        positions = torch.arange(len(token_ids)) - (query_start_loc[:-1] - torch.tensor(computed))[seq_of_token]
        block_tables = self._block_tables([self.kv.block_ids(r.request_id) for r in requests])
        block_of_token = block_tables[seq_of_token, positions // self.block_size].long()
        slot_mapping = block_of_token * self.block_size + positions % self.block_size
        seq_lens = [c + n for c, n in zip(computed, num_new)]
        logits_indices = query_start_loc[1:][[s.samples for s in scheduled]] - 1

        def to_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device, non_blocking=True)

        metadata = AttentionMetadata(
            block_tables=to_device(block_tables),
            seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32)),
            query_start_loc=to_device(query_start_loc),
            slot_mapping=to_device(slot_mapping),
            block_size=self.block_size,
            query_lens_host=num_new,
            seq_lens_host=seq_lens,
        )
        return StepInputs(
            input_ids=to_device(torch.tensor(token_ids)),
            positions=to_device(positions),
            metadata=self.backend.prepare(metadata),
            logits_indices=to_device(logits_indices.long()),
            prompt_rows=rows_to_score(scheduled, query_start_loc),
        )

    @staticmethod
    def _block_tables(tables: list[list[int]]) -> torch.Tensor:
        lengths = torch.tensor([len(t) for t in tables])
        out = torch.zeros(len(tables), max(1, int(lengths.max())), dtype=torch.int32)
        rows = torch.repeat_interleave(torch.arange(len(tables)), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        cols = torch.arange(int(lengths.sum())) - starts[rows]
        out[rows, cols] = torch.tensor(list(itertools.chain.from_iterable(tables)), dtype=torch.int32)
        return out

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of blocks shared by parallel samples, in every layer's cache."""
        source = torch.tensor([s for s, _ in copies], device=self.device)
        destination = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, destination, k_cache.index_select(0, source))
            v_cache.index_copy_(0, destination, v_cache.index_select(0, source))

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], copies: list[tuple[int, int]] | None = None) -> StepLogits:
        """Logits for the scheduled requests that sample this step, and the prompt logprobs asked for."""
        if copies:
            self.copy_blocks(copies)
        inputs = self.prepare(scheduled)
        start = time.perf_counter()
        if self.decode_graphs is not None and self.decode_graphs.can_run(inputs):
            hidden = self.decode_graphs.run(inputs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        prompt = score(self.model.compute_logits, hidden, inputs.prompt_rows) if inputs.prompt_rows else {}
        self.forward_seconds += time.perf_counter() - start
        self.num_tokens_processed += len(inputs.input_ids)
        return StepLogits(logits, prompt)
