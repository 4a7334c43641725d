"""Writing tiny GGUF files as llama.cpp's converter does: the settings every decoder file holds, SmolLM2's
tokenizer cut to the model's vocabulary, tensors under their GGUF names, and a cache folder of the test's own."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import gguf
import pytest
import torch
import transformers

SPECIAL_TOKENS = 17  # SmolLM2's <|endoftext|>, <|im_start|>, <|im_end|>, ...


def new_writer(path: Path, arch: str, config: transformers.PretrainedConfig, smol_dir: Path) -> gguf.GGUFWriter:
    """A writer holding the settings every decoder file has and the tokenizer; family settings are the caller's."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    add_tokenizer(writer, smol_dir, config.vocab_size)
    return writer


def close_writer(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tokenizer(writer: gguf.GGUFWriter, smol_dir: Path, vocab_size: int) -> None:
    """SmolLM2's byte-level BPE tokenizer cut to its first vocab_size tokens and the merges among them: a small
    embedding, and a GGUF that transformers converts in seconds."""
    model = json.loads((smol_dir / "tokenizer.json").read_text())["model"]
    tokens = sorted((i, token) for token, i in model["vocab"].items() if i < vocab_size)
    kept = {token for _, token in tokens}
    merges = [f"{a} {b}" for a, b in model["merges"] if a in kept and b in kept and a + b in kept]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([token for _, token in tokens])
    writer.add_token_types([3 if i < SPECIAL_TOKENS else 1 for i, _ in tokens])  # 3: control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)


def gguf_name(name: str, roles: Mapping[str, str]) -> str:
    """transformers' tensor name -> llama.cpp's; `roles` maps a module inside layer N to its role in block N."""
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    parts = name.split(".")  # model.layers.N.<module>.<weight or bias>
    return f"blk.{parts[2]}.{roles['.'.join(parts[3:-1])]}.{parts[-1]}"


@contextlib.contextmanager
def own_cache(folder: Path) -> Iterator[None]:
    """What pagedserve caches for a file (the converted tokenizer, fused layouts) goes under `folder`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDSERVE_CACHE_DIR", str(folder / "cache"))
        yield


def greedy_reference(model: transformers.PreTrainedModel, prompts: Sequence[list[int]], tokens: int = 16) -> list:
    """transformers' greedy continuation of each prompt; checked to vary, since a repeated token tests little."""
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            output = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False)
            expected.append(output[0, len(prompt) :].tolist())
    assert all(len(set(continuation)) > 3 for continuation in expected), "a model that repeats one token"
    return expected
