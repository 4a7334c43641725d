"""What a mixture-of-experts checkpoint adds to ModelSpec: its experts, their routing, where they sit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
}


@dataclass(frozen=True)
class MoeSpec:
    """What a mixture-of-experts checkpoint adds to ModelSpec."""

    family: str
    num_experts: int
    top_k: int
    expert_intermediate_size: int  # every expert's width (the whole model's, not a rank's)
    renormalize: bool  # the top-k weights divided by their sum
    sparse_layers: frozenset[int]  # layers with experts; the others have a dense MLP (Qwen3-MoE, Qwen2-MoE)
    clip_qkv: float | None  # OLMoE: q, k and v clamped to +-clip_qkv
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an expert every token takes, gated (0: none)

    @classmethod
    def from_hf_config(cls, config: Any, architecture: str) -> MoeSpec:
        family = MOE_ARCHITECTURES[architecture]
        layers = frozenset(range(config.num_hidden_layers))
        if family == "mixtral":  # always renormalised over the top k
            experts, width, renormalize, sparse = config.num_local_experts, config.intermediate_size, True, layers
        elif family == "olmoe":  # norm_topk_prob: false in OLMoE's checkpoints
            experts, width, sparse = config.num_experts, config.intermediate_size, layers
            renormalize = bool(config.norm_topk_prob)
        else:  # the Qwen MoEs: dense layers where mlp_only_layers or decoder_sparse_step say so
            experts, width, renormalize = config.num_experts, config.moe_intermediate_size, bool(config.norm_topk_prob)
            step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or ())
            sparse = frozenset(i for i in layers if i not in dense and experts > 0 and (i + 1) % step == 0)
        clip = getattr(config, "clip_qkv", None) if family == "olmoe" else None
        shared = getattr(config, "shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
        return cls(family, experts, config.num_experts_per_tok, width, renormalize, sparse, clip, shared)

    def split_problems(self, size: int) -> list[str]:
        """The expert widths `size` ranks cannot split."""
        widths = {
            "the experts'": self.expert_intermediate_size,
            "the shared expert's": self.shared_expert_intermediate_size,
        }
        return [f"{name} intermediate size {width}" for name, width in widths.items() if width % size]
