"""A Llama model's decoder layers as one native call per step, on the CPU (kernels/csrc/decoder_forward.c).

Calling a layer's dozen kernels one by one from Python costs about as much as their arithmetic when the
projections are ggml blocks and the batch is a few tokens (one stream's decode step: ~0.45 ms of Python per
layer against ~0.35 ms of kernels). The native forward runs the same kernels in the same order. It applies
where every op it composes applies: float32 on the CPU with the native library, every projection kept in a block
format, Llama layers (not Gemma's), no q/k norms, and a step whose every query row the native attention kernel
takes (decode rows, and prefill chunks of sequences the kernel attends faster than SDPA), of at most
MAX_TOKENS tokens, which bounds the step's scratch memory. Elsewhere the model's modules run as before.

Both paths multiply with the activations the backend's `activation_dtype` names (EngineConfig.activation_dtype,
set by `use_activation_dtype`): 8- or 16-bit ones for steps of fewer than integer_max_tokens(dtype) tokens
(kernels/quantized.py) where it says int8 or int16, counted without the step's proposed tokens (the backend's
proposed_rows), so that a verifying step multiplies as plain decoding's would have.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch

from pagedserve.engine.worker.models.layers import GatedMLP
from pagedserve.engine.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedserve.kernels import AttentionMetadata, RotaryAngles
from pagedserve.kernels.backend import KernelBackend
from pagedserve.kernels.cpu_attention import plan_attention
from pagedserve.kernels.cpu_backend import CpuBackend
from pagedserve.kernels.cpu_native import VECTOR_LANES, native_function
from pagedserve.kernels.quantized import QuantizedWeight, block_format, int8_linear_kernel, integer_max_tokens
from pagedserve.kernels.stacked_weight import ProjectionWeight, RowStackedWeight

if TYPE_CHECKING:
    from pagedserve.engine.worker.models.causal_lm import CausalLM
    from pagedserve.engine.worker.models.llama import KVCache

# The step's activations live in one scratch allocation of ~(3 hidden + qkv + 2 q + 3 intermediate) floats a
# token: 33 KiB for SmolLM2, 200 KiB for an 8B model, so 2048 tokens take 66-400 MiB.
MAX_TOKENS = 2048
QKV_PARTS = 3  # q, k and v as three weights where a file stores them in different formats

_pointer, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _BlockWeight(ctypes.Structure):
    _fields_ = [("blocks", _pointer), ("type", _i32)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _pointer),
        ("post_attention_norm", _pointer),
        ("qkv", _BlockWeight * QKV_PARTS),  # the fused weight in [0] (qkv_parts 1), or q, k, v (3)
        ("o", _BlockWeight),
        ("gate_up", _BlockWeight),
        ("down", _BlockWeight),
        ("qkv_parts", _i32),
        ("qkv_bias", _pointer),
        ("k_cache", _pointer),
        ("v_cache", _pointer),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64),
        ("hidden", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("block_size", _i64),
        ("num_slots", _i64),
        ("eps", _f32),
        ("scale", _f32),
        ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", _pointer),
        ("int8_max_tokens", _i64),
        ("activation_bits", _i64),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("tokens", _i64),
        ("cos", _pointer),
        ("sin", _pointer),
        ("slots", _pointer),
        ("block_tables", _pointer),
        ("block_table_stride", _i64),
        ("context_lens", _pointer),
        ("seq_ids", _pointer),
        ("query_rows", _pointer),
        ("num_queries", _i64),
    ]


NativeForward = Callable[..., int]


class CpuDecoder:
    """The model's layers and caches described once for the native forward; `forward` runs a step."""

    def __init__(self, model: LlamaForCausalLM, caches: Sequence[KVCache], function: NativeForward) -> None:
        spec, attention = model.spec, _attention(model.layers[0])
        self._function = function
        self._window = spec.sliding_window
        self._layers = (_Layer * spec.num_layers)(
            *(
                _describe(cast(LlamaDecoderLayer, layer), cache)
                for layer, cache in zip(model.layers, caches, strict=True)
            )
        )
        k_cache = caches[0][0]
        self._backend = model.backend
        activation_dtype = getattr(model.backend, "activation_dtype", "float32")
        self._int8_max_tokens = integer_max_tokens(activation_dtype)
        self._model = _Model(
            num_layers=spec.num_layers,
            hidden=spec.hidden_size,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            intermediate=spec.intermediate_size,
            block_size=k_cache.shape[1],
            num_slots=k_cache.numel() // (spec.num_kv_heads * spec.head_dim),
            eps=model.norm.eps,
            scale=attention.scale,
            layers=self._layers,
            final_norm=model.norm.weight.data_ptr(),
            int8_max_tokens=integer_max_tokens(activation_dtype),
            activation_bits=16 if activation_dtype == "int16" else 8,
        )

    @property
    def int8_max_tokens(self) -> int:
        """Steps of fewer tokens (proposed ones aside) multiply integer activations (0: none do)."""
        return self._int8_max_tokens

    @int8_max_tokens.setter
    def int8_max_tokens(self, tokens: int) -> None:
        self._int8_max_tokens = tokens

    def _integer_step(self, tokens: int) -> bool:
        return tokens - self._backend.proposed_rows < self._int8_max_tokens

    def forward(
        self, embeddings: torch.Tensor, angles: RotaryAngles, metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        """Hidden states [T, hidden] after the final norm, or None where this step is not the native forward's."""
        tokens = embeddings.shape[0]
        if tokens > MAX_TOKENS or embeddings.dtype != torch.float32:
            return None
        if self._window is not None and metadata.max_seq_len > self._window:
            return None  # the native attention reads whole contexts: beyond the window the layers' own do
        plan = metadata.plan if metadata.plan is not None else plan_attention(metadata)
        rows = plan.native_rows
        if plan.sdpa_prefills or rows.query_rows.numel() != tokens:
            return None
        cos, sin = angles.token_major_halves
        slots, tables = metadata.slot_mapping.contiguous(), metadata.block_tables
        step = _Step(
            tokens=tokens,
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            slots=slots.data_ptr(),
            block_tables=tables.data_ptr(),
            block_table_stride=tables.stride(0),
            context_lens=rows.context_lens.data_ptr(),
            seq_ids=rows.seq_ids.data_ptr(),
            query_rows=rows.query_rows.data_ptr(),
            num_queries=tokens,
        )
        # The native forward compares the step's tokens with this: above them, or 0, decides for it.
        self._model.int8_max_tokens = tokens + 1 if self._integer_step(tokens) else 0
        residual = embeddings.contiguous()  # a new tensor (the embedding lookup's): the residual stream in place
        out = torch.empty_like(residual)
        status = self._function(
            out.data_ptr(), residual.data_ptr(), ctypes.byref(self._model), ctypes.byref(step), torch.get_num_threads()
        )
        if status == -3:
            raise IndexError("decoder_forward: a slot is past the cache")
        if status != 0:
            raise MemoryError(f"decoder_forward failed ({status})")
        return out


def use_activation_dtype(backend: KernelBackend, setting: str) -> str:
    """Sets the CPU backend's activation dtype from EngineConfig.activation_dtype and returns it: "auto" is int16
    where the integer kernels are built (benchmarks/int8_activations.py: faster than float32 at decode;
    benchmarks/teacher_forcing.py: float32's tokens, where int8 moves ~2% of them), "float32" elsewhere. Other
    backends multiply float activations whatever the setting."""
    if not isinstance(backend, CpuBackend):
        return "float32"
    chosen = setting
    if setting == "auto":
        chosen = "int16" if int8_linear_kernel(sixteen_bits=True) is not None else "float32"
    backend.activation_dtype = chosen
    return chosen


def bind_kv_caches(model: CausalLM, caches: list[KVCache]) -> None:
    """Binds the model's layers to their caches, and chooses how its layers run: one native call where it
    applies, the model's modules elsewhere. The backend is chosen here, not in the model. (Only our own Llama
    layers have a native forward: the transformers fallback runs its modules.)"""
    model.bind_kv_caches(caches)
    if isinstance(model, LlamaForCausalLM):
        model.native_decoder = native_decoder(model, caches)


def native_decoder(model: LlamaForCausalLM, caches: Sequence[KVCache]) -> CpuDecoder | None:
    """The native forward for this model and these caches, or None where it does not apply."""
    function = native_function("decoder_forward_f32", [_pointer, _pointer, _pointer, _pointer, ctypes.c_int])
    if function is None or not _applies(model, caches):
        return None
    return CpuDecoder(model, caches, function)


def _applies(model: LlamaForCausalLM, caches: Sequence[KVCache]) -> bool:
    if not all(isinstance(layer, LlamaDecoderLayer) for layer in model.layers):
        return False  # layers of another kind (Gemma's norms, windows and soft-caps): the native forward is Llama's
    if model.backend.name != "cpu" or model.group is not None or model.spec.head_dim % VECTOR_LANES != 0:
        return False  # the native forward has no collectives: one rank holds the whole model
    tensors = [t for cache in caches for t in cache] + [model.norm.weight]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return False
    return all(_layer_applies(layer) for layer in model.layers)


def _layer_applies(layer: torch.nn.Module) -> bool:
    if not isinstance(getattr(layer, "mlp", None), GatedMLP):
        return False  # experts (models/moe.py): the native forward has no routed layer
    attention = _attention(layer)
    if attention.q_norm is not None:
        return False
    projections = (attention.qkv_proj, attention.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    if any(not isinstance(p.quantized, QuantizedWeight) for p in projections[1:]):  # every CPU format has a kernel
        return False
    qkv = attention.qkv_proj.quantized
    if not isinstance(qkv, QuantizedWeight) and not _qkv_parts_apply(qkv, attention):
        return False
    return all(p.bias is None for p in projections[1:])


def _attention(layer: torch.nn.Module) -> torch.nn.Module:
    return layer.self_attn  # type: ignore[return-value]


def _describe(layer: LlamaDecoderLayer, cache: KVCache) -> _Layer:
    attention, mlp = layer.self_attn, layer.mlp
    qkv_bias = attention.qkv_proj.bias
    return _Layer(
        input_norm=layer.input_layernorm.weight.data_ptr(),
        post_attention_norm=layer.post_attention_layernorm.weight.data_ptr(),
        qkv=_qkv_weights(attention.qkv_proj.quantized),
        qkv_parts=1 if isinstance(attention.qkv_proj.quantized, QuantizedWeight) else QKV_PARTS,
        o=_block_weight(attention.o_proj.quantized),
        gate_up=_block_weight(mlp.gate_up_proj.quantized),
        down=_block_weight(mlp.down_proj.quantized),
        qkv_bias=None if qkv_bias is None else qkv_bias.data_ptr(),
        k_cache=cache[0].data_ptr(),
        v_cache=cache[1].data_ptr(),
    )


def _block_weight(weight: ProjectionWeight | None) -> _BlockWeight:
    assert isinstance(weight, QuantizedWeight)
    return _BlockWeight(blocks=weight.blocks.data_ptr(), type=block_format(weight.qtype).ggml_type)


def _qkv_parts_apply(weight: ProjectionWeight | None, attention: torch.nn.Module) -> bool:
    """q, k and v as three CPU block weights of their rows (a file that stores them in different formats)."""
    if not isinstance(weight, RowStackedWeight) or len(weight.parts) != QKV_PARTS:
        return False
    q_size, kv_size = attention.q_size, attention.kv_size
    rows = [part.shape[0] for part in weight.parts]
    return rows == [q_size, kv_size, kv_size] and all(isinstance(part, QuantizedWeight) for part in weight.parts)


def _qkv_weights(weight: ProjectionWeight | None) -> ctypes.Array[_BlockWeight]:
    parts = weight.parts if isinstance(weight, RowStackedWeight) else (weight,)
    described = [_block_weight(part) for part in parts]
    return (_BlockWeight * QKV_PARTS)(*described, *[_BlockWeight()] * (QKV_PARTS - len(described)))
