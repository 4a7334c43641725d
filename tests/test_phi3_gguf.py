"""A Phi-3 GGUF file served from the file: attn_qkv and ffn_up (gate and up) fused as stored, kept as blocks,
greedy tokens equal to transformers' own GGUF loading; split over ranks, equal to one rank."""

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
from pagedserve.kernels.quantized import QuantizedWeight, dequantize, quantize
from tests.gguf_writing import close_writer, gguf_name, greedy_reference, new_writer, own_cache
from tests.test_gguf_families import COMMON, GGUF_NAMES, gguf_tensors
from tests.test_tensor_parallel import assert_same, engine_for, run_alone, workload

PROMPTS = [list(range(100, 108)), list(range(300, 340))]


def phi3_config() -> transformers.Phi3Config:
    return transformers.Phi3Config(**COMMON, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_phi3_gguf(path: Path, smol_dir: Path) -> None:
    config = phi3_config()
    writer = _writer(path, config, smol_dir)
    for name, data, qtype in gguf_tensors(config):
        writer.add_tensor(name, data, raw_dtype=qtype)
    close_writer(writer)


def _writer(path: Path, config: transformers.Phi3Config, smol_dir: Path) -> gguf.GGUFWriter:
    writer = new_writer(path, "phi3", config, smol_dir)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    return writer


@pytest.fixture(scope="module")
def phi3_file(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("phi3-gguf")
    path = folder / "tiny-phi3-q8_0.gguf"
    write_phi3_gguf(path, smol_dir)
    with own_cache(folder):
        yield path


def test_greedy_tokens_equal_transformers_reading_the_same_file(phi3_file: Path) -> None:
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        phi3_file.parent, gguf_file=phi3_file.name, dtype=torch.float32
    )
    expected = greedy_reference(reference, PROMPTS)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    config = EngineConfig(model=str(phi3_file), num_kv_blocks=32, engine_process=False, activation_dtype="float32")
    loaded = load_model(config)
    attention, mlp = loaded.model.layers[0].self_attn, loaded.model.layers[0].mlp
    assert isinstance(attention.qkv_proj.quantized, QuantizedWeight)  # blocks, as stored
    assert isinstance(mlp.gate_up_proj.quantized, QuantizedWeight)
    with LLM.from_config(config, loaded) as llm:
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected


def test_split_over_two_ranks_equals_one(phi3_file: Path) -> None:
    expected = run_alone(engine_for(phi3_file, 1, num_kv_blocks=24, max_num_batched_tokens=32), workload)
    actual = run_alone(engine_for(phi3_file, 2, num_kv_blocks=24, max_num_batched_tokens=32), workload)
    assert_same(expected, actual)


SWITCH = 32  # original_max_position_embeddings of the Phi-4-mini-shaped file


def phi4_mini_config() -> transformers.Phi3Config:
    pairs = 48  # 96 of 128 head dimensions rotated
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.02 * i for i in range(pairs)],
        "long_factor": [1.5 + 0.5 * i for i in range(pairs)],
        "original_max_position_embeddings": SWITCH,
    }
    return transformers.Phi3Config(
        **COMMON,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        partial_rotary_factor=0.75,
        rope_scaling=rope,
        original_max_position_embeddings=SWITCH,
    )


def write_phi4_mini_gguf(path: Path, model: transformers.PreTrainedModel, smol_dir: Path, blocks: bool) -> None:
    """The model's tensors by their GGUF names (matrices in Q8_0 with `blocks`, else F32), its RoPE as llama.cpp's
    converter writes it."""
    config = model.config
    writer = _writer(path, config, smol_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
    writer.add_rope_scaling_orig_ctx_len(SWITCH)
    for kind in ("short", "long"):
        factors = np.array(config.rope_parameters[f"{kind}_factor"], dtype=np.float32)
        writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        if blocks and tensor.dim() == 2:
            data = quantize(tensor.float(), "q8_0").blocks.numpy()
            writer.add_tensor(gguf_name(name, GGUF_NAMES), data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name(name, GGUF_NAMES), tensor.float().numpy())
    close_writer(writer)


def _rounded_to_q8_0(model: transformers.PreTrainedModel) -> None:
    """Every matrix set to its Q8_0 blocks dequantized: the float model a Q8_0 file holds."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(dequantize(quantize(parameter.float(), "q8_0")))


@pytest.mark.parametrize("blocks", [False, True])
def test_phi4_mini_file_rotates_as_the_model_it_was_written_from(tmp_path: Path, smol_dir: Path, blocks: bool) -> None:
    """Partial rotary dimensions and LongRoPE factors come from the file (transformers' GGUF config drops them):
    a short prompt, one that grows past the switch while decoding, a long one; the query and key rows of
    attn_qkv reordered as floats and as blocks."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(phi4_mini_config()).eval()
    if blocks:
        _rounded_to_q8_0(model)
    path = tmp_path / "tiny-phi4-mini.gguf"
    write_phi4_mini_gguf(path, model, smol_dir, blocks)
    prompts = [list(range(100, 108)), list(range(300, 324)), list(range(500, 540))]
    expected = greedy_reference(model, prompts)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with own_cache(tmp_path):
        config = EngineConfig(model=str(path), num_kv_blocks=32, engine_process=False, activation_dtype="float32")
        loaded = load_model(config)
        assert loaded.spec.long_rope_threshold == SWITCH
        qkv = loaded.model.layers[0].self_attn.qkv_proj.quantized
        assert isinstance(qkv, QuantizedWeight) == blocks
        with LLM.from_config(config, loaded) as llm:
            got = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
