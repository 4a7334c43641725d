"""Gemma 2 and Gemma 3 GGUF files, written with gguf-py as llama.cpp's converter writes them (its tensor names, norms
stored as 1 + weight, the soft-caps and Gemma 3's RoPE scaling under keys transformers does not read): projections
kept as blocks, greedy tokens equal to transformers running the same weights (dequantized) with the settings the
file holds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.model_loader import load_model
from pagedserve.engine.worker.models.gemma import GemmaForCausalLM
from pagedserve.kernels.quantized import QuantizedWeight, quantize
from pagedserve.kernels.quantized_reference import dequantize
from tests.gguf_writing import close_writer, gguf_name, greedy_reference, new_writer, own_cache

WINDOW = 8
COMMON = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    vocab_size=4096,  # the first tokens of SmolLM2's tokenizer (add_tokenizer)
    rms_norm_eps=1e-6,
    sliding_window=WINDOW,
    initializer_range=0.02,  # varied greedy tokens (more repeats one: the embedding, scaled by 16, dominates)
    tie_word_embeddings=True,
    query_pre_attn_scalar=64,  # head_dim: what llama.cpp derives for every Gemma but the 27B ones
    final_logit_softcapping=3.0,
)
# Layer patterns are the files' (none stored): Gemma 2 alternates, Gemma 3 has 5 sliding layers to a global one.
FAMILIES = {
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, num_hidden_layers=2, attn_logit_softcapping=2.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **COMMON, num_hidden_layers=6, rope_scaling={"rope_type": "linear", "factor": 2.0}
    ),
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


def write_gguf(path: Path, family: str, smol_dir: Path) -> transformers.PreTrainedModel:
    """A random Gemma as a GGUF file: projections and the embedding in Q8_0, norms (random, not the zeros
    transformers starts them at) in F32 as 1 + weight. Returns the model with the file's weights, dequantized."""
    config = FAMILIES[family]()
    config._attn_implementation = "eager"  # the implementation that soft-caps
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    writer = new_writer(path, family, config, smol_dir)
    _write_settings(writer, config)
    state = model.state_dict()
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue  # tied
        stored_name = gguf_name(name, GGUF_NAMES)
        if tensor.dim() == 2:
            blocks = quantize(tensor.float(), "q8_0")
            writer.add_tensor(stored_name, blocks.blocks.numpy(), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            state[name] = dequantize(blocks)
        else:
            state[name] = torch.randn_like(tensor)
            writer.add_tensor(stored_name, (state[name] + 1).numpy(), raw_dtype=gguf.GGMLQuantizationType.F32)
    close_writer(writer)
    model.load_state_dict(state)
    return model.eval()


def _write_settings(writer: gguf.GGUFWriter, config: transformers.PretrainedConfig) -> None:
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    else:
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_parameters["full_attention"]["factor"])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def gemma_file(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smol_dir: Path
) -> Iterator[tuple[Path, transformers.PreTrainedModel]]:
    folder = tmp_path_factory.mktemp(request.param)
    path = folder / f"tiny-{request.param}-q8_0.gguf"
    model = write_gguf(path, request.param, smol_dir)
    with own_cache(folder):
        yield path, model


def test_greedy_tokens_equal_transformers_on_the_same_weights(gemma_file) -> None:
    path, reference = gemma_file
    prompts = [list(range(100, 112)), list(range(300, 340))]  # both longer than the window
    expected = greedy_reference(reference, prompts)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    config = EngineConfig(model=str(path), num_kv_blocks=32, engine_process=False, activation_dtype="float32")
    loaded = load_model(config)
    assert isinstance(loaded.model, GemmaForCausalLM)
    assert isinstance(loaded.model.layers[0].self_attn.qkv_proj.quantized, QuantizedWeight)  # blocks, as stored
    settings, gemma2 = loaded.model.settings, reference.config.model_type == "gemma2"
    assert (settings.attention_soft_cap, settings.final_soft_cap) == ((2.0 if gemma2 else None), 3.0)
    if not gemma2:
        assert loaded.hf_config.rope_parameters["full_attention"]["rope_type"] == "linear"
    with LLM.from_config(config, loaded) as llm:
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert loaded.model.native_decoder is None  # block-format projections, but Gemma's layers run layer by layer
