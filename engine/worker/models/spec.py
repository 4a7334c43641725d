"""ModelSpec: the few facts about a Llama-family checkpoint that our implementation needs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.worker.models.partial_rope import long_rope_switch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",  # Phi-3, Phi-4-mini (models/phi3.py)
    "Gemma2ForCausalLM": "gemma2",  # models/gemma.py
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",  # image and text: served as its text model, text in and out
    # mixtures of experts (models/moe.py)
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
}
PER_LAYER_WINDOWS = ("gemma2", "gemma3_text")  # windowed layers attend over their window (models/gemma.py)


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
    sliding_window: int | None  # Mistral v0.1's (and Qwen2's where use_sliding_window): every layer's window
    eos_token_ids: tuple[int, ...]
    expert_intermediate_size: int | None = None  # Qwen3-MoE's experts' width, where it differs from the MLP's

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
        if family == "gemma3":
            return _text_model_spec(cls.from_hf_config(config.text_config), config)
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        eos = config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = getattr(config, "sliding_window", None)
        qwen2 = family in ("qwen2", "qwen2_moe")
        if (qwen2 and not getattr(config, "use_sliding_window", False)) or family in PER_LAYER_WINDOWS:
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
            qkv_bias=qwen2 or bool(getattr(config, "attention_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=window,
            eos_token_ids=eos_ids,
            expert_intermediate_size=getattr(config, "moe_intermediate_size", None),
        )

    @property
    def long_rope_threshold(self) -> int | None:
        """LongRoPE's original_max_position_embeddings: a longer sequence is rotated with the long factors
        throughout (models/partial_rope.py); None for other RoPE."""
        return long_rope_switch(self.rope_parameters)

    # ---- tensor parallelism (Megatron-style: heads and the MLP width split across ranks) --------------

    def tensor_parallel_problems(self, size: int) -> list[str]:
        """Why the model cannot be split over `size` ranks (empty when it can). KV heads may be fewer than the
        ranks if the ranks are a multiple of them: each KV head is then replicated on size / num_kv_heads ranks."""
        problems = []
        if self.num_heads % size:
            problems.append(f"num_attention_heads {self.num_heads}")
        if self.num_kv_heads % size and size % self.num_kv_heads:
            problems.append(f"num_key_value_heads {self.num_kv_heads}")
        if self.intermediate_size % size:
            problems.append(f"intermediate_size {self.intermediate_size}")
        if self.expert_intermediate_size is not None and self.expert_intermediate_size % size:
            problems.append(f"moe_intermediate_size {self.expert_intermediate_size}")
        return problems

    def tensor_parallel_sizes(self) -> list[int]:
        """Every size the model can be split over."""
        return [size for size in range(1, self.num_heads + 1) if not self.tensor_parallel_problems(size)]

    def check_tensor_parallel(self, size: int) -> None:
        problems = self.tensor_parallel_problems(size)
        if problems:
            raise ValueError(
                f"{self.architecture} cannot be split over tensor_parallel_size {size}: {', '.join(problems)} "
                f"not divisible by it; sizes that work: {', '.join(map(str, self.tensor_parallel_sizes()))}"
            )

    def for_rank(self, size: int) -> ModelSpec:
        """The part of the model one of `size` ranks holds: its query heads, KV heads (at least one) and MLP
        width. The vocabulary is split separately (padded to a multiple of `size`)."""
        if size == 1:
            return self
        self.check_tensor_parallel(size)
        return dataclasses.replace(
            self,
            num_heads=self.num_heads // size,
            num_kv_heads=max(1, self.num_kv_heads // size),
            intermediate_size=self.intermediate_size // size,
        )

    def first_kv_head(self, rank: int, size: int) -> int:
        """The first KV head rank `rank` of `size` holds (KV heads replicated: the one its query heads read)."""
        if self.num_kv_heads >= size:
            return rank * (self.num_kv_heads // size)
        return rank // (size // self.num_kv_heads)


def _text_model_spec(text_spec: ModelSpec, config: Any) -> ModelSpec:
    """An image-text model's text model, ending on the tokens the whole model's config names."""
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return dataclasses.replace(text_spec, eos_token_ids=eos_ids or text_spec.eos_token_ids)


def _rope_parameters(config: Any) -> dict[str, Any]:
    """transformers >= 5 normalises RoPE settings into `rope_parameters`; older configs split them."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return scaling
