"""ModelSpec: the few facts about a Llama-family checkpoint that our implementation needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3
    sliding_window: int | None  # Mistral v0.1; we serve up to the window, not beyond
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        # Configs converted from GGUF name only a model_type; map it to its architecture.
        by_type = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
        architectures = getattr(config, "architectures", None) or [by_type.get(config.model_type, "")]
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {architectures or config.model_type!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        eos = config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = getattr(config, "sliding_window", None)
        if family == "qwen2" and not getattr(config, "use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_parameters=_rope_parameters(config),
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=window,
            eos_token_ids=eos_ids,
        )


def _rope_parameters(config: Any) -> dict[str, Any]:
    """transformers >= 5 normalises RoPE settings into `rope_parameters`; older configs split them."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return scaling
