"""Our Llama-family implementation against transformers, logit for logit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.kv_caches import allocate_kv_caches
from pagedserve.engine.worker.kv_sizing import model_len_limit
from pagedserve.engine.worker.model_loader import load_model
from pagedserve.engine.worker.models import ModelSpec
from pagedserve.engine.worker.native_decoder import bind_kv_caches
from pagedserve.kernels import AttentionMetadata


def our_logits(model_dir: Path, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Logits of every position, computed in prefill chunks of `chunk` tokens over a paged cache."""
    loaded = load_model(EngineConfig(model=str(model_dir)))
    block_size = 16
    num_blocks = -(-len(token_ids) // block_size)
    bind_kv_caches(
        loaded.model, allocate_kv_caches(loaded.spec, num_blocks + 2, block_size, torch.float32, loaded.device)
    )
    # Blocks in reverse order, so the block table really is followed.
    table = torch.arange(num_blocks + 1, 0, -1, dtype=torch.int32)[:num_blocks].unsqueeze(0)
    pieces = []
    for start in range(0, len(token_ids), chunk):
        end = min(start + chunk, len(token_ids))
        positions = torch.arange(start, end)
        slots = table[0, positions // block_size].long() * block_size + positions % block_size
        metadata = AttentionMetadata(
            block_tables=table,
            seq_lens=torch.tensor([end], dtype=torch.int32),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            slot_mapping=slots,
            block_size=block_size,
            query_lens_host=[end - start],
            seq_lens_host=[end],
        )
        with torch.inference_mode():
            hidden = loaded.model(torch.tensor(token_ids[start:end]), positions, loaded.backend.prepare(metadata))
            pieces.append(loaded.model.compute_logits(hidden))
    return torch.cat(pieces)


@pytest.mark.parametrize("family", ["llama", "llama3-rope", "mistral", "mistral-window", "qwen2", "qwen3"])
def test_logits_match_transformers(family: str, tiny_model_dir: Callable[[str], Path]) -> None:
    folder = tiny_model_dir(family)
    token_ids = torch.randint(0, 49152, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(our_logits(folder, token_ids, chunk=45), expected, atol=1e-4, rtol=1e-4)
    # Chunked prefill (a chunk starting mid-sequence, then single-token steps) gives the same logits.
    torch.testing.assert_close(our_logits(folder, token_ids, chunk=7), expected, atol=1e-4, rtol=1e-4)
    if family == "mistral-window":  # one token a step: the native decoder inside the window, the layers past it
        torch.testing.assert_close(our_logits(folder, token_ids, chunk=1), expected, atol=1e-4, rtol=1e-4)


def test_a_sliding_window_is_attended_not_a_context_cap(tiny_model_dir: Callable[[str], Path]) -> None:
    spec = ModelSpec.from_hf_config(transformers.AutoConfig.from_pretrained(tiny_model_dir("mistral-window")))
    assert spec.sliding_window == 8 and model_len_limit(spec) == 2048


def test_spec_reads_family_features(tiny_model_dir: Callable[[str], Path]) -> None:
    qwen2 = ModelSpec.from_hf_config(transformers.AutoConfig.from_pretrained(tiny_model_dir("qwen2")))
    qwen3 = ModelSpec.from_hf_config(transformers.AutoConfig.from_pretrained(tiny_model_dir("qwen3")))
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings and not qwen2.qk_norm
    assert qwen3.qk_norm and qwen3.head_dim == 32


def test_unsupported_architecture_names_the_supported_ones() -> None:
    config = transformers.GPT2Config()
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        ModelSpec.from_hf_config(config)
