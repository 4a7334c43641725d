"""A loaded model's CPU block weights re-laid, once, for the kernels its activation dtype chooses.

With int16 activations on a CPU with AVX2, Q4_0, Q4_K and Q6_K weights multiply faster with their rows interleaved
eight at a time (kernels/interleaved_rows.py): each one is copied into that layout (the same bytes, another order)
and the file's layout dropped, a weight at a time, so the process never holds more than one extra weight. That
covers the projections, an untied LM head, and a tied one together with the embedding that looks rows up in the
same blocks (one copy for both: lookups read the interleaved table). Where AMX's tile unit takes a format (it reads
the file's layout: Q4_0 there), with float32 activations, and for weights no layout covers (other formats, a row
count not a multiple of eight), nothing changes.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from torch import nn

from pagedserve.engine.worker.loaded_model import LoadedModel
from pagedserve.engine.worker.models.causal_lm import CausalLM
from pagedserve.engine.worker.models.layers import Linear, QuantizedEmbedding
from pagedserve.engine.worker.models.llama import LlamaForCausalLM
from pagedserve.engine.worker.native_decoder import use_activation_dtype
from pagedserve.kernels import KernelBackend
from pagedserve.kernels.interleaved_rows import ROW_GROUP, interleave_rows, interleaves, rows8_kernel_built
from pagedserve.kernels.quantized import QuantizedWeight, tile_unit_takes
from pagedserve.kernels.stacked_weight import ProjectionWeight, RowStackedWeight

logger = logging.getLogger(__name__)
W = TypeVar("W", bound=ProjectionWeight)


def use_activations(loaded: LoadedModel, setting: str) -> str:
    """Sets the loaded model's activation dtype from EngineConfig.activation_dtype (native_decoder's
    use_activation_dtype) and lays its weights out for it; returns the dtype chosen."""
    chosen = use_activation_dtype(loaded.backend, setting)
    lay_out_for_kernels(loaded.model, loaded.backend)
    return chosen


def lay_out_for_kernels(model: CausalLM, backend: KernelBackend) -> int:
    """Re-lays `model`'s block weights for the backend's activation dtype where that pays; returns how many."""
    if not interleaving_pays(backend) or not isinstance(model, nn.Module):
        return 0
    laid_out: dict[int, ProjectionWeight] = {}  # id of a weight as loaded -> as laid out: a shared one is done once

    def relaid(weight: W) -> W:
        if id(weight) not in laid_out:
            laid_out[id(weight)] = _interleaved(weight)
        return laid_out[id(weight)]  # type: ignore[return-value]  # _interleaved keeps a weight's kind

    for module in model.modules():
        if isinstance(module, Linear) and module.quantized is not None:
            module.quantized = relaid(module.quantized)
        elif isinstance(module, QuantizedEmbedding):
            module.table = relaid(module.table)
        elif isinstance(module, LlamaForCausalLM) and isinstance(module.quantized_head, QuantizedWeight):
            module.quantized_head = relaid(module.quantized_head)
    count = sum(id(new) != old for old, new in laid_out.items())
    if count:
        logger.info("%d block weights laid out for the 16-bit product (rows interleaved by %d)", count, ROW_GROUP)
    return count


def interleaving_pays(backend: KernelBackend) -> bool:
    """Whether interleaved layouts multiply faster here: int16 activations and the vector kernels."""
    return getattr(backend, "activation_dtype", "float32") == "int16" and rows8_kernel_built()


def _interleaved(weight: ProjectionWeight) -> ProjectionWeight:
    """`weight` interleaved where a layout covers it (each part of a stacked one), else `weight` itself."""
    if isinstance(weight, RowStackedWeight):
        parts = tuple(_interleaved(part) for part in weight.parts)
        changed = any(new is not old for new, old in zip(parts, weight.parts))
        return RowStackedWeight(parts) if changed else weight  # type: ignore[arg-type]
    if isinstance(weight, QuantizedWeight) and interleaves(weight) and not tile_unit_takes(weight.qtype):
        return interleave_rows(weight)
    return weight
