"""Gemma 2 and Gemma 3 GGUF files (written with gguf-py from random transformers models, as llama.cpp's converter
writes them: norms stored as 1 + weight, llama.cpp's tensor names): projections kept as blocks, greedy tokens equal
to transformers reading the same file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.model_loader import load_model
from pagedserve.engine.worker.models.gemma import GemmaForCausalLM
from pagedserve.kernels.quantized import QuantizedWeight, quantize
from tests.test_kquants import add_tokenizer

WINDOW = 8
COMMON = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    vocab_size=4096,  # the first tokens of SmolLM2's tokenizer (add_tokenizer)
    rms_norm_eps=1e-6,
    sliding_window=WINDOW,
    initializer_range=0.02,  # varied greedy tokens (more repeats one: the embedding, scaled by 16, dominates)
    tie_word_embeddings=True,
)
# What transformers reads back from a GGUF: its defaults where the file has no key (softcaps, query scale, layer
# pattern), so the random models are made with them too.
FAMILIES = {
    "gemma2": lambda: transformers.Gemma2Config(**COMMON),
    "gemma3": lambda: transformers.Gemma3TextConfig(**COMMON),
}
GGUF_NAMES = {  # transformers' module inside layer N -> the GGUF tensor's role in block N (llama.cpp's names)
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_tensors(config: transformers.PretrainedConfig) -> Iterator[tuple[str, np.ndarray, gguf.GGMLQuantizationType]]:
    """A random Gemma's tensors by GGUF name: projections and the embedding in Q8_0; norms (random, not the zeros
    transformers starts them at) in F32 as 1 + weight, the way llama.cpp's converter stores them."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        values = tensor.detach().float()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            parts = name.split(".")  # model.layers.N.<module>.weight
            gguf_name = f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        if values.dim() == 2:
            yield gguf_name, quantize(values, "q8_0").blocks.numpy(), gguf.GGMLQuantizationType.Q8_0
        else:
            yield gguf_name, (torch.randn_like(values) + 1).numpy(), gguf.GGMLQuantizationType.F32


def write_gguf(path: Path, family: str, smol_dir: Path) -> None:
    config = FAMILIES[family]()
    writer = gguf.GGUFWriter(path, family)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    writer.add_vocab_size(config.vocab_size)
    add_tokenizer(writer, smol_dir)
    for name, data, qtype in gguf_tensors(config):
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def gemma_file(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smol_dir: Path
) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp(request.param)
    path = folder / f"tiny-{request.param}-q8_0.gguf"
    write_gguf(path, request.param, smol_dir)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDSERVE_CACHE_DIR", str(folder / "cache"))
        yield path


def test_greedy_tokens_equal_transformers_reading_the_same_file(gemma_file: Path) -> None:
    prompts = [list(range(100, 112)), list(range(300, 340))]  # both longer than the window
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gemma_file.parent, gguf_file=gemma_file.name, dtype=torch.float32, attn_implementation="eager"
    )
    expected = []
    for prompt in prompts:
        output = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
        expected.append(output[0, len(prompt) :].tolist())
    assert all(len(set(tokens)) > 3 for tokens in expected), "a model that repeats one token would test little"
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    config = EngineConfig(model=str(gemma_file), num_kv_blocks=32, engine_process=False, activation_dtype="float32")
    loaded = load_model(config)
    assert isinstance(loaded.model, GemmaForCausalLM)
    assert isinstance(loaded.model.layers[0].self_attn.qkv_proj.quantized, QuantizedWeight)  # blocks, as stored
    with LLM.from_config(config, loaded) as llm:
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
