"""Tiny random mixture-of-experts models of each family natively served, saved with transformers (float32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,  # Mixtral's and OLMoE's experts; Qwen3-MoE's dense layers
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    vocab_size=49152,  # the SmolLM2 tokenizer's
    eos_token_id=2,
    bos_token_id=1,
    initializer_range=0.1,  # experts whose outputs move the tokens (at 0.02 the residual stream decides them)
)
MOE_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    # layer 1 dense (mlp_only_layers), renormalised top-k, per-head q/k norms
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # a shared expert beside the routed ones, its own width; q/k/v biases; top-k not renormalised
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
    ),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    # top-k not renormalised, q/k norms over the whole projections, q/k/v clamped
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, clip_qkv=3.0),
}


def save_moe_model(family: str, folder: Path, tokenizer_dir: Path, **overrides: object) -> transformers.PreTrainedModel:
    """Saves a random model of `family` (its config changed by `overrides`) with SmolLM2's tokenizer into
    `folder`; returns it (eval mode)."""
    torch.manual_seed(0)
    config = MOE_CONFIGS[family]()
    for name, value in overrides.items():
        setattr(config, name, value)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return model


def greedy_reference(model: transformers.PreTrainedModel, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time."""
    out = []
    with torch.no_grad():
        for ids in prompts:
            generated = model.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones(1, len(ids))
            )
            out.append(generated[0, len(ids) :].tolist())
    return out
