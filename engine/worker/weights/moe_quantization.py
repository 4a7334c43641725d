"""A float MoE checkpoint's experts quantized on load (`quantization: q8_0`, `q4_k`, ...), as the projections are
(weights/on_load_quantization.py): the experts hold most of an MoE model's weights, and a decode step reads only
its top-k experts' rows, so their block formats are what make such a model fast on a CPU.

Blocks run along each row's input features: a rank's gate/up rows are whole blocks, and its down columns (its
slice of the expert width) are whole blocks where that width is a multiple of the format's block. Where it is
not, the experts stay float on every rank alike (logged)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from pagedserve.engine.worker.models.moe import MoeForCausalLM
from pagedserve.engine.worker.models.moe_blocks import SparseMoeBlock
from pagedserve.kernels.device_blocks import AnyQuantizedWeight
from pagedserve.kernels.quantized import QuantizedWeight, block_format, quantize

logger = logging.getLogger(__name__)
Place = Callable[[QuantizedWeight], AnyQuantizedWeight]


def quantize_experts_on_load(model: object, qtype: str, formats: frozenset[str], place: Place) -> int:
    """Every float expert stack of `model` in `qtype` where the backend multiplies it here; the bytes stored."""
    if not isinstance(model, MoeForCausalLM) or qtype not in formats:
        return 0
    stacks = [
        layer.mlp.experts
        for layer in model.layers
        if isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.experts.quantized is None
    ]
    block = block_format(qtype).block_weights
    if any(stack.hidden_size % block or stack.intermediate_size % block for stack in stacks):
        logger.info("experts stay float: hidden size or this rank's expert width is not whole %s blocks", qtype)
        return 0
    stored = 0
    for stack in stacks:
        experts, hidden, width = stack.num_experts, stack.hidden_size, stack.intermediate_size
        float_gate_up = stack.gate_up_proj.detach().float().cpu().view(experts, 2 * width, hidden)
        float_down = stack.down_proj.detach().float().cpu().view(experts, hidden, width)
        gate_up = [place(quantize(weight, qtype)) for weight in float_gate_up]
        down = [place(quantize(weight, qtype)) for weight in float_down]
        stack.use_quantized(gate_up, down)
        stored += sum(weight.nbytes for weight in [*gate_up, *down])
    return stored
