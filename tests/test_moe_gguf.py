"""Qwen3-MoE and Mixtral GGUF files (llama.cpp's qwen3moe layout, and Mixtral's: a "llama" file with experts and
q/k rows permuted as llama.cpp's converter does), written with gguf-py from random transformers models, served
from the file: the experts' 3-D tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps) kept as Q8_0 blocks, one
weight per expert, and greedy tokens equal to transformers' on the dequantized model."""

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
from tests.gguf_writing import close_writer, greedy_reference, new_writer, own_cache

COMMON = dict(
    hidden_size=256,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=2048,
    vocab_size=4096,  # the first tokens of SmolLM2's tokenizer (add_tokenizer)
    rms_norm_eps=1e-6,
    initializer_range=0.1,  # varied greedy tokens
    tie_word_embeddings=True,
)
CONFIG = dict(  # Qwen3-MoE's
    COMMON,
    intermediate_size=512,
    moe_intermediate_size=64,
    num_experts=4,
    norm_topk_prob=True,  # what transformers assumes for a qwen3moe GGUF (llama.cpp's convention)
    head_dim=128,
)
FAMILIES = {  # GGUF architecture: the transformers config of a tiny random model
    "qwen3moe": lambda: transformers.Qwen3MoeConfig(**CONFIG),
    "llama": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=64, num_local_experts=4),
    "qwen2moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=512, moe_intermediate_size=64, shared_expert_intermediate_size=96, num_experts=4
    ),
}
ROLES = {  # transformers' name inside layer N -> the GGUF tensor's role in block N
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
Q8_0 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32


def q8_0(values: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """(the blocks of a 2-D or 3-D weight, the weight they dequantize to)."""
    if values.dim() == 3:
        parts = [q8_0(matrix) for matrix in values]
        return np.stack([blocks for blocks, _ in parts]), torch.stack([weight for _, weight in parts])
    weight = quantize(values, "q8_0")
    return weight.blocks.numpy(), dequantize(weight)


def gguf_tensors(state: dict[str, torch.Tensor]) -> Iterator[tuple[str, str, np.ndarray, gguf.GGMLQuantizationType]]:
    """(transformers' name, GGUF name, data, type) of each tensor; the experts split into gate, up and down."""
    for name, tensor in state.items():
        values = tensor.detach().float()
        if name == "lm_head.weight":
            continue  # tied
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            gguf_name = "token_embd.weight" if "embed" in name else "output_norm.weight"
            yield name, gguf_name, values.numpy(), (Q8_0 if "embed" in name else F32)
            continue
        parts = name.split(".")  # model.layers.N.<module>.<param>
        block = f"blk.{parts[2]}"
        if name.endswith("experts.gate_up_proj"):
            gate, up = values.chunk(2, dim=1)
            yield f"{name}#gate", f"{block}.ffn_gate_exps.weight", gate.numpy(), Q8_0
            yield f"{name}#up", f"{block}.ffn_up_exps.weight", up.numpy(), Q8_0
        elif name.endswith("experts.down_proj"):
            yield name, f"{block}.ffn_down_exps.weight", values.numpy(), Q8_0
        else:
            role = ROLES[".".join(parts[3:-1])]
            if role == "ffn_gate_inp_shexp":  # llama.cpp's shape: one weight a hidden feature
                values = values.reshape(-1)
            quantized = values.dim() == 2 and role != "ffn_gate_inp"  # llama.cpp keeps the routers in F32
            yield name, f"{block}.{role}.{parts[-1]}", values.numpy(), (Q8_0 if quantized else F32)


def write_gguf(path: Path, smol_dir: Path, arch: str = "qwen3moe") -> transformers.PreTrainedModel:
    """Writes the file; returns the transformers model with the weights the file dequantizes to."""
    config = FAMILIES[arch]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    writer = new_writer(path, arch, config, smol_dir)
    if arch == "qwen3moe":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch != "llama":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    dequantized: dict[str, list[torch.Tensor]] = {}
    for name, gguf_name, data, qtype in gguf_tensors(model.state_dict()):
        if qtype == Q8_0:
            data, weight = q8_0(torch.from_numpy(data))
        else:
            weight = torch.from_numpy(data)
        dequantized.setdefault(name.partition("#")[0], []).append(weight)
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
            data = data[llama_cpp_row_order(data.shape[0], heads)]
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    close_writer(writer)
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    state = {
        name: (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).reshape(shapes[name])
        for name, parts in dequantized.items()
    }
    model.load_state_dict(state, strict=False)  # lm_head: tied
    return model


def llama_cpp_row_order(rows: int, heads: int) -> np.ndarray:
    """The rows llama.cpp's converter writes a Llama q or k weight in (each head's rotary halves interleaved)."""
    return np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_file(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smol_dir: Path
) -> Iterator[tuple[Path, transformers.PreTrainedModel]]:
    folder = tmp_path_factory.mktemp(request.param)
    path = folder / f"tiny-{request.param}-moe-q8_0.gguf"
    reference = write_gguf(path, smol_dir, request.param)
    with own_cache(folder):
        yield path, reference


def test_experts_load_as_blocks_and_greedy_tokens_equal_transformers(moe_file) -> None:
    path, reference = moe_file
    prompts = [list(range(100, 108)), list(range(300, 340))]
    expected = greedy_reference(reference, prompts)
    config = EngineConfig(model=str(path), num_kv_blocks=32, engine_process=False, activation_dtype="float32")
    loaded = load_model(config)
    experts = loaded.model.layers[0].mlp.experts
    assert experts.quantized is not None and experts.gate_up_proj.numel() == 0  # blocks, no float copy
    assert all(
        isinstance(w, QuantizedWeight) and w.qtype == "q8_0"
        for w in [*experts.quantized.gate_up, *experts.quantized.down]
    )
    if reference.config.model_type == "qwen2_moe":  # the shared expert's projections: blocks too
        assert isinstance(loaded.model.layers[0].mlp.shared_expert.gate_up_proj.quantized, QuantizedWeight)
    width = getattr(reference.config, "moe_intermediate_size", reference.config.intermediate_size)
    assert experts.quantized.gate_up[0].shape == (2 * width, reference.config.hidden_size)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM.from_config(config, loaded) as llm:
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


def test_float_experts_where_blocks_are_not_kept(moe_file) -> None:
    """quantization "none": the experts dequantized into the float stacks, the same tokens."""
    path, reference = moe_file
    prompt = list(range(300, 340))
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
    config = EngineConfig(model=str(path), num_kv_blocks=32, engine_process=False, quantization="none")
    loaded = load_model(config)
    assert loaded.model.layers[1].mlp.experts.quantized is None
    with LLM.from_config(config, loaded) as llm:
        got = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected
