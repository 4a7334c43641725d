"""Gemma 2 and Gemma 3 (text) over the paged KV cache.

What sets them apart from the Llama family (llama.py), as transformers computes it:
- sliding-window layers interleaved with global ones (`layer_types`); each layer passes its window to the kernels;
- attention logits soft-capped (Gemma 2's `attn_logit_softcapping`; transformers' Gemma 3 ignores the setting),
  and final logits soft-capped where `final_logit_softcapping` is set;
- RMSNorm by (1 + weight): the checkpoint's weight plus one is stored, so the backend's norms run unchanged
  (GGUF files store it so already); four norms a layer: before and after attention and the MLP;
- embeddings scaled by sqrt(hidden_size), queries by query_pre_attn_scalar ** -0.5;
- a GELU (tanh) gated MLP; Gemma 3's q/k norms and its RoPE bases per layer type (rope_local_base_freq for the
  sliding layers).
The layers form KV cache groups by attention kind (kv_groups.py): each group has its own block tables, and a
windowed group's blocks go back to the pool once they fall out of its window (scheduling/windowed_blocks.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from pagedserve.engine.worker.distributed.group import TensorParallelGroup
from pagedserve.engine.worker.kv_groups import kv_cache_groups
from pagedserve.engine.worker.models.gemma_settings import (
    NORM_SUFFIX,
    GemmaRotary,
    GemmaSettings,
    text_model_name,
)
from pagedserve.engine.worker.models.layers import (
    GatedMLP,
    RMSNorm,
)
from pagedserve.engine.worker.models.llama import (
    CheckpointSlice,
    KVCache,
    LlamaAttention,
    LlamaForCausalLM,
)
from pagedserve.engine.worker.models.spec import ModelSpec
from pagedserve.kernels import AttentionMetadata, KernelBackend, RotaryAngles


def gemma_attention(
    spec: ModelSpec, settings: GemmaSettings, layer: int, backend: KernelBackend, group: TensorParallelGroup | None
) -> LlamaAttention:
    """Layer `layer`'s attention: Llama's, with Gemma's query scale, q/k norms (Gemma 3), window and soft-cap."""
    return LlamaAttention(
        spec,
        backend,
        group,
        scale=settings.query_scale,
        qk_norm=settings.qk_norm,
        sliding_window=settings.window(layer),
        soft_cap=settings.attention_soft_cap,
    )


class GeluGatedMLP(GatedMLP):
    """Gemma's MLP: GELU (tanh approximation) where Llama's has SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        settings: GemmaSettings,
        layer: int,
        backend: KernelBackend,
        group: TensorParallelGroup | None,
    ) -> None:
        super().__init__()
        self.layer_type = settings.layer_types[layer]
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, backend)
        self.self_attn = gemma_attention(spec, settings, layer, backend, group)
        self.post_attention_layernorm = RMSNorm(hidden, eps, backend)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, backend)
        self.mlp = GeluGatedMLP(hidden, spec.intermediate_size, backend, group)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, backend)

    def forward(
        self, angles: RotaryAngles, hidden: torch.Tensor, residual: torch.Tensor | None, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's normed MLP output, the residual stream before it), as LlamaDecoderLayer returns them."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.add_and_forward(hidden, residual)
        attended = self.post_attention_layernorm(self.self_attn(angles, hidden, metadata))
        hidden, residual = self.pre_feedforward_layernorm.add_and_forward(attended, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text. Shares Llama's loading, quantizing, tensor-parallel slicing and LM head; never runs
    the native CPU decoder (its fused forward is a Llama layer's)."""

    # our parameter in layer N -> its GGUF tensor in block N (llama.cpp's names for Gemma 2 and 3)
    gguf_layer_floats: ClassVar[dict[str, str]] = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
    }

    def setup_positions(self, hf_config: Any, max_positions: int, rotary: nn.Module | None) -> None:
        """Gemma's settings, its KV cache groups, and cos/sin tables per layer type (`rotary`: built beforehand, for
        a model built on the meta device)."""
        assert rotary is None or isinstance(rotary, GemmaRotary)
        spec = self.spec
        self.settings = GemmaSettings.from_hf_config(hf_config)
        self.rotary_by_type = rotary if rotary is not None else GemmaRotary(spec.head_dim, max_positions, hf_config)
        self.kv_groups = kv_cache_groups([self.settings.window(i) for i in range(spec.num_layers)])
        group_of_layer = self.kv_groups.group_of_layer()
        self.kv_group_of_layer = [group_of_layer[i] for i in range(spec.num_layers)]
        self.shares_kv_caches = False  # whether layers of different groups share cache tensors (bind_kv_caches)

    def decoder_layer(self, index: int) -> nn.Module:
        return GemmaDecoderLayer(self.rank_spec, self.settings, index, self.backend, self.group)

    def bind_kv_caches(self, caches: list[KVCache]) -> None:
        for layer, cache in zip(self.layers, caches, strict=True):
            assert isinstance(layer, GemmaDecoderLayer)
            layer.self_attn.kv_cache = cache
        self.shares_kv_caches = len({id(k_cache) for k_cache, _ in caches}) < len(caches)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        embeddings = self.embed_tokens(input_ids)
        # The scale rounded to the activations' dtype first, as transformers does (bfloat16: 55.5 for sqrt(3072));
        # a Python number, so that a recorded CUDA graph holds no tensor made at capture.
        embeddings = embeddings * _rounded(self.spec.hidden_size**0.5, embeddings.dtype)
        angles = self.rotary_by_type.angles(positions)
        hidden = self.backend.in_linear_output_layout(embeddings)
        # Caches shared by the KV cache groups need each group's block tables; caches of their own (a draft model,
        # profiling) take the one table for all layers.
        by_group = metadata.groups or [metadata] * self.kv_groups.num_groups
        assert metadata.groups or not self.shares_kv_caches, "grouped KV caches need each group's block tables"
        residual = None
        for layer, group in zip(self.layers, self.kv_group_of_layer):
            assert isinstance(layer, GemmaDecoderLayer)
            hidden, residual = layer(angles[layer.layer_type], hidden, residual, by_group[group])
        assert residual is not None, "a model has at least one layer"
        return self.norm.add_and_forward(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.settings.final_soft_cap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' checkpoint names, as Llama's (an image-text model's text model's among them); norms stored
        as (1 + weight), what they multiply by."""
        text_weights = ((text_model_name(name), tensor) for name, tensor in weights)
        super().load_weights(
            (name, tensor.float() + 1 if name.endswith(NORM_SUFFIX) else tensor)
            for name, tensor in text_weights
            if name is not None
        )

    def checkpoint_slice(self, hf_name: str) -> CheckpointSlice | None:
        name = text_model_name(hf_name)
        return None if name is None else super().checkpoint_slice(name)


def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype))
