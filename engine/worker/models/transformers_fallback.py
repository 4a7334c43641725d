"""Any decoder transformers can build, run by its own modules over pagedserve's paged KV cache.

The model is transformers' AutoModelForCausalLM with its attention implementation set to ours
(models/transformers_attention.py): projections, norms, rotary embeddings and MLPs are the model's own modules;
each layer's attention writes into the paged cache and attends over it with the kernel backend. The runner
drives it like LlamaForCausalLM: one flat batch of tokens a step (a batch of one sequence of T tokens to
transformers, whose position ids restart per request), the step's metadata, and logits only for the rows it asks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from pagedserve.engine.worker.distributed.group import TensorParallelGroup
from pagedserve.engine.worker.models.spec import ModelSpec
from pagedserve.engine.worker.models.transformers_attention import (
    KVCache,
    LayerAttention,
    PagedStep,
    Probe,
    paged_step,
)
from pagedserve.kernels import AttentionMetadata, KernelBackend

# RoPE variants whose frequencies change once a batch holds a position past the original context: in a flat
# batch of many requests one long request would change them for all. The fallback serves up to that length.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
DEFAULT_MAX_POSITIONS = 2048  # for configs that name no context length


class TransformersForCausalLM(nn.Module):
    """A transformers causal LM behind the interface the runner, the CUDA graphs and the KV sizing use."""

    records_in_cuda_graphs = False  # runs eagerly: not yet recorded and replayed on a GPU

    def __init__(self, hf_model: PreTrainedModel, backend: KernelBackend, eos_token_ids: tuple[int, ...]) -> None:
        super().__init__()
        if hf_model.base_model is hf_model:
            raise ValueError(f"{type(hf_model).__name__} has no decoder apart from its LM head (base_model_prefix)")
        self.hf_model = hf_model
        self.backend = backend
        self.group: TensorParallelGroup | None = None  # the fallback runs whole on one rank
        self.spec = fallback_spec(hf_model, probe_attention(hf_model), eos_token_ids)
        self.rank_spec = self.spec
        self.kv_caches: list[KVCache] = []
        self._given_hidden = _GivenHidden()

    @property
    def decoder(self) -> nn.Module:
        """The model without its LM head: the embeddings, the layers and the final norm."""
        return self.hf_model.base_model

    def bind_kv_caches(self, caches: list[KVCache]) -> None:
        if len(caches) != self.spec.num_layers:
            raise ValueError(f"{len(caches)} KV caches for {self.spec.num_layers} attention layers")
        self.kv_caches = caches

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of the flat batch input_ids [T] at positions [T]."""
        assert self.kv_caches, "bind_kv_caches() before the first forward"
        with paged_step(PagedStep(metadata, self.kv_caches, self.backend)):
            out = self.decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return _last_hidden_state(out)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [R, vocab] of hidden [R, hidden], as the model's own head computes them. Models differ after
        the LM head's product (Granite divides by logits_scaling, Cohere multiplies by logit_scale, Gemma
        soft-caps, ...): the causal LM's forward runs whole, its decoder standing aside for `hidden`."""
        prefix = self.hf_model.base_model_prefix
        decoder = getattr(self.hf_model, prefix)
        self._given_hidden.hidden = hidden[None]
        setattr(self.hf_model, prefix, self._given_hidden)
        try:
            dummy_ids = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            logits = self.hf_model(input_ids=dummy_ids, use_cache=False).logits
        finally:
            setattr(self.hf_model, prefix, decoder)
            self._given_hidden.hidden = None
        return logits[0]


class _GivenHidden(nn.Module):
    """Stands in for a model's decoder: returns the hidden states it was given, whatever it is asked."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> BaseModelOutputWithPast:
        return BaseModelOutputWithPast(last_hidden_state=self.hidden)


def _last_hidden_state(out: Any) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


@torch.inference_mode()
def probe_attention(hf_model: PreTrainedModel) -> dict[int, LayerAttention]:
    """Each layer's attention shapes, by layer index, from a forward of two tokens. Raises where a layer hands
    paged attention something it cannot compute."""
    probe = Probe()
    device = next(hf_model.parameters()).device
    with paged_step(probe):
        hf_model.base_model(
            input_ids=torch.zeros(1, 2, dtype=torch.long, device=device),
            position_ids=torch.arange(2, device=device)[None],
            use_cache=False,
        )
    return probe.layers


def fallback_spec(
    hf_model: PreTrainedModel, layers: dict[int, LayerAttention], eos_token_ids: tuple[int, ...]
) -> ModelSpec:
    """The facts the KV cache and the scheduler need, from the config and what the probe saw."""
    config = hf_model.config
    architecture = type(hf_model).__name__
    _check_layers(architecture, config, layers)
    first = layers[0]
    windows = [layer.sliding_window for layer in layers.values() if layer.sliding_window is not None]
    head = hf_model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{architecture} has no LM head")
    return ModelSpec(
        architecture=architecture,
        vocab_size=int(head.weight.shape[0]),
        hidden_size=int(getattr(config, "hidden_size", 0) or 0),
        intermediate_size=int(getattr(config, "intermediate_size", 0) or 0),
        num_layers=len(layers),
        num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        rms_norm_eps=0.0,  # the model's own norms run
        rope_parameters=dict(getattr(config, "rope_parameters", None) or {}),
        max_position_embeddings=max_positions(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=False,
        qk_norm=False,
        # The narrowest window (each layer's own reaches the paged kernels with its query: transformers_attention).
        sliding_window=min(windows) if windows else None,
        eos_token_ids=eos_token_ids,
    )


def _check_layers(architecture: str, config: Any, layers: dict[int, LayerAttention]) -> None:
    """One cache layout for every layer, and every layer's attention paged."""
    expected = getattr(config, "num_hidden_layers", None)
    if not layers or sorted(layers) != list(range(len(layers))) or (expected and len(layers) != expected):
        raise ValueError(
            f"{architecture}: {len(layers)} of {expected or '?'} layers attend through transformers' attention "
            "interface; the others (recurrent or state-space layers, or attention the model computes itself) "
            "would not see the paged cache"
        )
    shapes = {(layer.num_heads, layer.num_kv_heads, layer.head_dim) for layer in layers.values()}
    if len(shapes) > 1:
        raise ValueError(f"{architecture}: layers differ in attention shape {sorted(shapes)}; one KV layout serves all")
    if any(layer.value_head_dim != layer.head_dim for layer in layers.values()):
        raise ValueError(f"{architecture}: keys and values differ in head size; the paged cache holds one")


def max_positions(config: Any) -> int:
    """The longest request the fallback serves: the model's context, or less where RoPE depends on length."""
    limit = getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_POSITIONS
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) in LENGTH_DEPENDENT_ROPE:
        original = rope.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        if original:
            limit = min(limit, int(original))
    return int(limit)
