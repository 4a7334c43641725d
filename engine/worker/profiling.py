"""CUDA memory profiling: how much the activations of the largest step need, so the KV cache gets the rest."""

from __future__ import annotations

import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.kv_caches import allocate_kv_caches
from pagedserve.engine.worker.loaded_model import LoadedModel
from pagedserve.engine.worker.native_decoder import bind_kv_caches
from pagedserve.kernels import AttentionMetadata


@torch.inference_mode()
def profile_forward_peak(loaded: LoadedModel, config: EngineConfig) -> int:
    """Peak bytes allocated by one forward over `max_num_batched_tokens` tokens (weights included).

    The pass runs on a one-block scratch cache: every token's slot is -1 (no writes) and the block table
    points at block 0, so attention reads real memory of the right size without a real cache.
    """
    device, block_size = loaded.device, config.block_size
    num_tokens = config.max_num_batched_tokens
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    bind_kv_caches(loaded.model, allocate_kv_caches(loaded.spec, 1, block_size, loaded.dtype, device))
    metadata = AttentionMetadata(
        block_tables=torch.zeros(1, -(-num_tokens // block_size), dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=device),
        block_size=block_size,
        query_lens_host=[num_tokens],
        seq_lens_host=[num_tokens],
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    hidden = loaded.model(input_ids, positions, loaded.backend.prepare(metadata))
    # The sampler sees at most max_num_seqs rows of float32 logits.
    loaded.model.compute_logits(hidden[: config.max_num_seqs]).float()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    return peak
