"""GGUF files of the Qwen families served from the file: q/k/v biases (Qwen2) and q/k norms (Qwen3) read by
their GGUF names, greedy tokens equal to transformers' own GGUF loading."""

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
from pagedserve.kernels.quantized import QuantizedWeight, quantize
from tests.gguf_writing import close_writer, gguf_name, greedy_reference, new_writer, own_cache

COMMON = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 128: what transformers assumes for a Qwen3 GGUF (it stores none)
    num_key_value_heads=1,
    max_position_embeddings=2048,
    vocab_size=4096,  # the first tokens of SmolLM2's tokenizer (add_tokenizer)
    rms_norm_eps=1e-6,
    initializer_range=0.1,  # varied greedy tokens
    tie_word_embeddings=True,
)
FAMILIES = {
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=128),
}
GGUF_NAMES = {  # transformers' name inside layer N -> the GGUF tensor's role in block N
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused tensors (tests/test_phi3_gguf.py)
    "mlp.gate_up_proj": "ffn_up",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_tensors(config: transformers.PretrainedConfig) -> Iterator[tuple[str, np.ndarray, gguf.GGMLQuantizationType]]:
    """A random model's tensors by GGUF name: projections and the embedding in Q8_0, the rest F32."""
    torch.manual_seed(0)
    state = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue  # tied
        values = tensor.detach().float()
        if values.dim() == 2:
            yield gguf_name(name, GGUF_NAMES), quantize(values, "q8_0").blocks.numpy(), gguf.GGMLQuantizationType.Q8_0
        else:
            yield gguf_name(name, GGUF_NAMES), values.numpy(), gguf.GGMLQuantizationType.F32


def write_gguf(path: Path, family: str, smol_dir: Path) -> None:
    config = FAMILIES[family]()
    writer = new_writer(path, family, config, smol_dir)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    for name, data, qtype in gguf_tensors(config):
        writer.add_tensor(name, data, raw_dtype=qtype)
    close_writer(writer)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_file(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smol_dir: Path
) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp(request.param)
    path = folder / f"tiny-{request.param}-q8_0.gguf"
    write_gguf(path, request.param, smol_dir)
    with own_cache(folder):
        yield path


def test_greedy_tokens_equal_transformers_reading_the_same_file(family_file: Path) -> None:
    prompts = [list(range(100, 108)), list(range(300, 340))]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        family_file.parent, gguf_file=family_file.name, dtype=torch.float32
    )
    expected = greedy_reference(reference, prompts)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    config = EngineConfig(model=str(family_file), num_kv_blocks=32, engine_process=False, activation_dtype="float32")
    loaded = load_model(config)
    assert isinstance(loaded.model.layers[0].self_attn.qkv_proj.quantized, QuantizedWeight)  # blocks, as stored
    with LLM.from_config(config, loaded) as llm:
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
