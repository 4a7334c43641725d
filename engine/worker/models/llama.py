"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

Inputs are one flat batch of tokens from many sequences. All arithmetic goes through the kernel backend: it
writes each layer's new keys/values into its cache blocks, attends over the blocks of each sequence, and runs
the projections, norms and activations.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.worker.distributed.group import TensorParallelGroup
from pagedserve.engine.worker.models.layers import (
    Embedding,
    GatedMLP,
    Linear,
    QuantizedEmbedding,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    projection,
    vocab_rows_per_rank,
)
from pagedserve.engine.worker.models.partial_rope import PartialRotaryEmbedding, needs_partial_rope
from pagedserve.engine.worker.models.spec import ModelSpec
from pagedserve.kernels import AttentionMetadata, KernelBackend, RotaryAngles
from pagedserve.kernels.device_blocks import AnyQuantizedWeight
from pagedserve.kernels.quantized import QuantizedWeight
from pagedserve.kernels.stacked_weight import ProjectionWeight, RowStackedWeight

KVCache = tuple[torch.Tensor, torch.Tensor]
CheckpointSlice = tuple[int, int, int]  # (dim, start, stop) of a checkpoint tensor that one rank reads
VOCAB_PARAMETERS = ("embed_tokens.weight", "lm_head.weight")


class LlamaAttention(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        backend: KernelBackend,
        group: TensorParallelGroup | None,
        *,
        scale: float | None = None,
        qk_norm: bool | None = None,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> None:
        """`spec`: this rank's part of the model (ModelSpec.for_rank) when it is split over `group`. The keywords
        are what another family sets otherwise (Gemma: its query scale, q/k norms, window and soft-cap); by default
        head_dim ** -0.5, the spec's q/k norms, the whole context, no cap."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5 if scale is None else scale
        self.sliding_window = spec.sliding_window if sliding_window is None else sliding_window  # Mistral v0.1's
        self.soft_cap = soft_cap
        qk_norm = spec.qk_norm if qk_norm is None else qk_norm
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias, backend=backend)
        self.o_proj = projection(self.q_size, spec.hidden_size, backend, group)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, backend) if qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, backend) if qk_norm else None
        self.backend = backend
        self.kv_cache: KVCache | None = None

    def forward(self, angles: RotaryAngles, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.backend.rotary(angles, q, k)
        assert self.kv_cache is not None, "bind_kv_caches() before the first forward"
        k_cache, v_cache = self.kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = self.backend.paged_attention(
            q, k_cache, v_cache, metadata, self.scale, sliding_window=self.sliding_window, soft_cap=self.soft_cap
        )
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend: KernelBackend, group: TensorParallelGroup | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        self.self_attn = LlamaAttention(spec, backend, group)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, backend, group)

    def forward(
        self, angles: RotaryAngles, hidden: torch.Tensor, residual: torch.Tensor | None, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it). The residual add is folded into the next
        norm, so the caller adds the returned output to the stream: hidden + residual is the layer's result."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.add_and_forward(hidden, residual)
        hidden = self.self_attn(angles, hidden, metadata)
        hidden, residual = self.post_attention_layernorm.add_and_forward(hidden, residual)
        return self.mlp(hidden), residual


class FusedLayers(Protocol):
    """Every decoder layer and the final norm in one call: hidden states [T, hidden], or None for a step the
    call does not take (the modules run it)."""

    def forward(
        self, embeddings: torch.Tensor, angles: RotaryAngles, metadata: AttentionMetadata
    ) -> torch.Tensor | None: ...


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        hf_config: Any,
        backend: KernelBackend,
        max_positions: int,
        group: TensorParallelGroup | None = None,
        rotary: nn.Module | None = None,
    ) -> None:
        """`group`: the ranks the model is split over (Megatron-style), None for the whole model here. Split,
        a rank holds its query and KV heads, its share of the MLP width and of the vocabulary. `rotary`: cos/sin
        tables built beforehand (a model built on the meta device takes real ones), else built here."""
        super().__init__()
        self.spec = spec
        self.group = group
        self.rank_spec = spec.for_rank(1 if group is None else group.size)
        self.backend = backend
        self.setup_positions(hf_config, max_positions, rotary)
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding | QuantizedEmbedding = (
            Embedding(spec.vocab_size, spec.hidden_size)
            if group is None
            else VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, group)
        )
        self.layers = nn.ModuleList(self.decoder_layer(index) for index in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        head_rows = spec.vocab_size if group is None else vocab_rows_per_rank(spec.vocab_size, group.size)
        self.lm_head = (
            None if spec.tie_word_embeddings else Linear(spec.hidden_size, head_rows, bias=False, backend=backend)
        )
        self.quantized_head: AnyQuantizedWeight | None = None  # a tied head's blocks (embed_from_quantized_head)
        # The layers as one call, where the backend has one for this model (the worker sets it: the native
        # CPU decoder); None runs the layers' modules.
        self.native_decoder: FusedLayers | None = None

    def setup_positions(self, hf_config: Any, max_positions: int, rotary: nn.Module | None) -> None:
        """What the layers need before they are built: the cos/sin tables (`rotary` where built beforehand); a
        subclass reads its own settings here too (models/gemma.py)."""
        assert rotary is None or isinstance(rotary, RotaryEmbedding)
        self.rotary = rotary if rotary is not None else rotary_embedding(self.spec, hf_config, max_positions)

    def decoder_layer(self, index: int) -> nn.Module:
        """Layer `index`, for this rank (a subclass builds other layers: models/moe.py, gemma.py)."""
        return LlamaDecoderLayer(self.rank_spec, self.backend, self.group)

    def weight_target(self, hf_name: str) -> tuple[str, tuple[int, int] | None] | None:
        """transformers' tensor name -> (our parameter, row range inside a fused parameter or None), or None to
        skip it."""
        return _map_weight_name(hf_name, self.rank_spec)

    def bind_kv_caches(self, caches: list[KVCache]) -> None:
        for layer, cache in zip(self.layers, caches, strict=True):
            assert isinstance(layer, LlamaDecoderLayer)
            layer.self_attn.kv_cache = cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of the flat batch input_ids [T] at positions [T]."""
        embeddings = self.embed_tokens(input_ids)
        angles = self.rotary.angles(positions)
        if self.native_decoder is not None:
            hidden = self.native_decoder.forward(embeddings, angles, metadata)
            if hidden is not None:
                return hidden
        hidden = self.backend.in_linear_output_layout(embeddings)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(angles, hidden, residual, metadata)
        assert residual is not None, "a model has at least one layer"
        return self.norm.add_and_forward(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [R, vocab] of hidden [R, hidden]. Split over ranks, every rank computes its vocabulary slice
        and rank 0 gathers them: only its result is the logits (the other ranks get their own slice back)."""
        logits = self._local_logits(hidden)
        if self.group is None:
            return logits
        return self.group.gather_columns(logits)[:, : self.spec.vocab_size]

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.backend.logits(hidden, self.lm_head.stored_weight)  # a head has no bias
        if self.quantized_head is not None:
            return self.backend.logits(hidden, self.quantized_head)
        assert not isinstance(self.embed_tokens, QuantizedEmbedding)  # a float tied head: the embedding is float
        return self.backend.logits(hidden, self.embed_tokens.weight)

    def use_quantized(self, weights: Mapping[str, ProjectionWeight]) -> None:
        """Projections ("layers.3.mlp.down_proj", "lm_head") that multiply by stored blocks from now on; their
        float copies are dropped (a tied head keeps the embedding, which lookups still read)."""
        modules = dict(self.named_modules())
        for name, weight in weights.items():
            if name == "lm_head":
                if self.lm_head is not None:
                    self.lm_head.use_quantized(weight)
                else:
                    assert not isinstance(weight, RowStackedWeight), "a head is one tensor"
                    self.quantized_head = weight
                continue
            module = modules.get(name)
            if not isinstance(module, Linear):
                raise ValueError(f"{name!r} is not a projection of this model")
            module.use_quantized(weight)

    def embed_from_quantized_head(self) -> None:
        """Looks tokens up in the tied head's blocks from now on and drops the float embedding. Only where the
        embedding is those blocks dequantized (a GGUF file's token_embd), not for a head quantized at load. Lookups
        read CPU blocks: a head repacked for the GPU leaves the embedding float. Split over ranks, the head's rows
        are this rank's share of the vocabulary, as the embedding's were."""
        if self.lm_head is not None or not isinstance(self.quantized_head, QuantizedWeight):
            raise ValueError("only a tied LM head kept as CPU blocks can serve as the embedding")
        self.embed_tokens = QuantizedEmbedding(self.quantized_head, self.group)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads transformers-named tensors, fusing q/k/v and gate/up as they arrive. Split over ranks, each
        tensor is this rank's slice of the checkpoint's (checkpoint_slice)."""
        params = dict(self.named_parameters())
        rows_loaded = dict.fromkeys(params, 0)
        for hf_name, tensor in weights:
            target = self.weight_target(hf_name)
            if target is None:
                continue
            name, rows = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.spec.architecture}")
            destination = params[name].data if rows is None else params[name].data[rows[0] : rows[1]]
            if name in VOCAB_PARAMETERS and len(tensor) < len(destination):  # the last rank's padding rows
                tensor = F.pad(tensor, (0, 0, 0, len(destination) - len(tensor)))
            if destination.shape != tensor.shape:
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(destination.shape)}")
            destination.copy_(tensor)
            rows_loaded[name] += destination.shape[0]
        missing = sorted(name for name, p in params.items() if rows_loaded[name] != p.shape[0])
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def checkpoint_slice(self, hf_name: str) -> CheckpointSlice | None:
        """The part of a checkpoint tensor this rank holds, or None for all of it (always, unsplit)."""
        if self.group is None:
            return None
        return rank_slice(hf_name, self.spec, self.group.rank, self.group.size)


def rotary_embedding(spec: ModelSpec, hf_config: Any, max_positions: int) -> RotaryEmbedding:
    """The model's cos/sin tables, on the default device."""
    if needs_partial_rope(spec.head_dim, spec.rope_parameters):
        return PartialRotaryEmbedding(spec.head_dim, max_positions, spec.rope_parameters, hf_config)
    return RotaryEmbedding(spec.head_dim, max_positions, spec.rope_parameters, hf_config)


def rank_slice(hf_name: str, spec: ModelSpec, rank: int, size: int) -> CheckpointSlice | None:
    """The part of checkpoint tensor `hf_name` that rank `rank` of `size` holds. Megatron's layout: q/k/v and
    gate/up split by output rows (column-parallel), o_proj and down_proj by input columns (row-parallel), the
    embedding and an untied LM head by vocabulary rows; norms whole."""
    name = hf_name.removeprefix("model.")
    if name in VOCAB_PARAMETERS:
        rows = vocab_rows_per_rank(spec.vocab_size, size)
        first = min(rank * rows, spec.vocab_size)
        return 0, first, min(first + rows, spec.vocab_size)
    module = name.rpartition(".")[0].rpartition(".")[2]
    ours = spec.for_rank(size)
    heads, mlp = ours.num_heads * spec.head_dim, ours.intermediate_size
    kv_first = spec.first_kv_head(rank, size) * spec.head_dim
    kv = ours.num_kv_heads * spec.head_dim
    by_module = {
        "q_proj": (0, rank * heads, (rank + 1) * heads),
        "k_proj": (0, kv_first, kv_first + kv),
        "v_proj": (0, kv_first, kv_first + kv),
        "o_proj": (1, rank * heads, (rank + 1) * heads),
        "gate_proj": (0, rank * mlp, (rank + 1) * mlp),
        "up_proj": (0, rank * mlp, (rank + 1) * mlp),
        "down_proj": (1, rank * mlp, (rank + 1) * mlp),
    }
    return by_module.get(module)


def _fused_rows(spec: ModelSpec) -> dict[str, tuple[str, tuple[int, int]]]:
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", (0, q)),
        "self_attn.k_proj": ("self_attn.qkv_proj", (q, q + kv)),
        "self_attn.v_proj": ("self_attn.qkv_proj", (q + kv, q + 2 * kv)),
        "mlp.gate_proj": ("mlp.gate_up_proj", (0, inter)),
        "mlp.up_proj": ("mlp.gate_up_proj", (inter, 2 * inter)),
    }


def _map_weight_name(hf_name: str, spec: ModelSpec) -> tuple[str, tuple[int, int] | None] | None:
    """transformers' tensor name -> (our parameter, row range inside a fused parameter or None)."""
    if "rotary_emb" in hf_name:
        return None
    if hf_name == "lm_head.weight" and spec.tie_word_embeddings:
        return None
    name = hf_name.removeprefix("model.")
    if not name.startswith("layers."):
        return name, None
    _, index, rest = name.split(".", 2)
    module, _, param = rest.rpartition(".")
    fused = _fused_rows(spec).get(module)
    if fused is None:
        return name, None
    return f"layers.{index}.{fused[0]}.{param}", fused[1]
