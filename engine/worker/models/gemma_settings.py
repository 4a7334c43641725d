"""What a Gemma model needs beyond the ModelSpec, from transformers' config: per-layer windows and types,
soft-caps, the query scale, RoPE tables per layer type; and the text model inside an image-text Gemma 3."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve.kernels import RotaryAngles

GEMMA_ARCHITECTURES = frozenset({"Gemma2ForCausalLM", "Gemma3ForCausalLM"})
SLIDING = "sliding_attention"
NORM_SUFFIX = "norm.weight"  # every norm of the model, q/k norms and the final one included
# An image-text Gemma 3 checkpoint (Gemma3ForConditionalGeneration) holds its image tower's tensors, skipped, and
# names its text model's "language_model.model.*" (transformers' saved form) or "model.language_model.*".
IMAGE_MODEL_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def text_config(hf_config: Any) -> Any:
    """The text model's config: an image-text model's `text_config`, else the config itself."""
    return getattr(hf_config, "text_config", None) or hf_config


def text_model_name(hf_name: str) -> str | None:
    """A checkpoint tensor's name as a text-only Gemma names it; None for the image tower's tensors."""
    if hf_name.startswith(IMAGE_MODEL_PREFIXES):
        return None
    if hf_name.startswith("model.language_model."):
        return "model." + hf_name.removeprefix("model.language_model.")
    return hf_name.removeprefix("language_model.")


@dataclass(frozen=True)
class GemmaSettings:
    """What a Gemma layer needs beyond the ModelSpec, read from transformers' config."""

    layer_types: tuple[str, ...]  # "sliding_attention" or "full_attention", per layer
    sliding_window: int
    query_scale: float
    attention_soft_cap: float | None
    final_soft_cap: float | None
    qk_norm: bool  # Gemma 3

    @classmethod
    def from_hf_config(cls, config: Any) -> GemmaSettings:
        """From a Gemma's config, or an image-text Gemma 3's (its text model's settings)."""
        text = text_config(config)
        if text.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported Gemma hidden_activation {text.hidden_activation!r}")
        gemma3 = text.model_type == "gemma3_text"
        return cls(
            layer_types=tuple(text.layer_types),
            sliding_window=text.sliding_window,
            query_scale=text.query_pre_attn_scalar**-0.5,
            attention_soft_cap=None if gemma3 else text.attn_logit_softcapping,
            # transformers' image-text Gemma 3 leaves its logits uncapped (its checkpoints set no cap anyway)
            final_soft_cap=text.final_logit_softcapping if text is config else None,
            qk_norm=gemma3,
        )

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


class GemmaRotary(nn.Module):
    """cos/sin tables per layer type: Gemma 3's sliding layers rotate with a base of their own."""

    def __init__(self, head_dim: int, max_positions: int, hf_config: Any) -> None:
        super().__init__()
        hf_config = text_config(hf_config)
        self.layer_types = sorted(set(hf_config.layer_types))
        positions = torch.arange(max_positions, dtype=torch.float32)
        for layer_type in self.layer_types:
            inv_freq, scaling = _inverse_frequencies(hf_config, layer_type, head_dim)
            freqs = torch.outer(positions, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer(f"{layer_type}_cos", emb.cos() * scaling, persistent=False)
            self.register_buffer(f"{layer_type}_sin", emb.sin() * scaling, persistent=False)

    def angles(self, positions: torch.Tensor) -> dict[str, RotaryAngles]:
        return {
            kind: RotaryAngles(getattr(self, f"{kind}_cos")[positions], getattr(self, f"{kind}_sin")[positions])
            for kind in self.layer_types
        }


def _inverse_frequencies(hf_config: Any, layer_type: str, head_dim: int) -> tuple[torch.Tensor, float]:
    """Gemma 3 keeps RoPE settings per layer type, Gemma 2 one set for all layers."""
    params = hf_config.rope_parameters
    nested = layer_type in params
    params = params[layer_type] if nested else params
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    extra = {"layer_type": layer_type} if nested else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **extra)
    return inv_freq.float(), float(scaling)
