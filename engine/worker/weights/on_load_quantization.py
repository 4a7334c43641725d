"""`quantization: q8_0` (or another block format): a float checkpoint's projections quantized as it loads.

Every projection, and the LM head, whose input size is a multiple of the format's block (32 weights, 256 for
the K-quants) is quantized, rounding as ggml does; the others stay float. Split over tensor-parallel ranks,
each rank quantizes only its shards. A column-parallel shard is whole rows, which quantize as the whole
model's rows do. A row-parallel shard (o_proj, down_proj) is a slice of the input columns starting at rank *
width: whole blocks when the width is a multiple of the block, and then they quantize as the whole model's do.
When it is not, the projection stays float on that rank, holding what the whole model's blocks hold: the
blocks its columns fall in are read from the checkpoint, quantized, dequantized and cut back to its columns.
Either way a split model multiplies by the weights the whole one does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedserve.engine.worker.models import LlamaForCausalLM
from pagedserve.engine.worker.models.layers import Linear, RowParallelLinear, VocabParallelEmbedding
from pagedserve.engine.worker.weights.checkpoint import read_checkpoint_part
from pagedserve.kernels.quantized import QuantizedWeight, block_format, dequantize, quantize

logger = logging.getLogger(__name__)


def quantized_on_load(model: LlamaForCausalLM, qtype: str, checkpoint: Path | None) -> dict[str, QuantizedWeight]:
    """This rank's projections (all of them, unsplit) quantized to `qtype`. `checkpoint`: the directory the
    weights were read from, to round the row-parallel shards that stay float (None: random weights)."""
    block = block_format(qtype).block_weights
    weights: dict[str, QuantizedWeight] = {}
    too_narrow: list[str] = []
    off_blocks: list[str] = []
    for name, weight, whole_in_features in _float_projections(model):
        if whole_in_features % block:
            too_narrow.append(name)
        elif weight.shape[1] % block:
            off_blocks.append(name)
        else:
            weights[name] = quantize(weight, qtype)
    if too_narrow:
        logger.info(
            "%d projections stay float: their input size is not a multiple of %s's %d", len(too_narrow), qtype, block
        )
    if off_blocks:
        _round_as_whole_blocks(model, off_blocks, qtype, checkpoint)
    return weights


def _float_projections(model: LlamaForCausalLM) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(name, this rank's float weight, the whole projection's input size) of every projection and a tied head."""
    for name, module in model.named_modules():
        if isinstance(module, RowParallelLinear):
            yield name, module.weight.data, module.in_features * module.group.size
        elif isinstance(module, Linear):
            yield name, module.weight.data, module.in_features
    if model.lm_head is None and isinstance(model.embed_tokens, torch.nn.Embedding | VocabParallelEmbedding):
        table = model.embed_tokens.weight.data  # this rank's vocabulary rows when split: the head's too
        yield "lm_head", table, table.shape[1]


def _round_as_whole_blocks(model: LlamaForCausalLM, names: list[str], qtype: str, checkpoint: Path | None) -> None:
    """Row-parallel shards off block boundaries keep float weights, set to what the whole model's blocks hold."""
    assert model.group is not None, "unsplit, every input size that is a multiple of the block quantizes"
    if checkpoint is not None:
        modules = dict(model.named_modules())
        for name in names:
            _round_shard(model, name, modules[name].weight.data, qtype, checkpoint)
    logger.info(
        "%d row-parallel projections stay float on rank %d of %d (%s): their input columns here are not whole "
        "%d-weight blocks of %s: %s",
        len(names),
        model.group.rank,
        model.group.size,
        "as the whole model's blocks round them" if checkpoint is not None else "random weights, not rounded",
        block_format(qtype).block_weights,
        qtype,
        ", ".join(names),
    )


def _round_shard(model: LlamaForCausalLM, name: str, weight: torch.Tensor, qtype: str, checkpoint: Path) -> None:
    """Sets the shard `weight` of projection `name` to its columns of the whole weight's blocks, dequantized:
    the blocks its columns fall in are read, quantized and dequantized."""
    part = model.checkpoint_slice(f"{name}.weight")
    assert part is not None and part[0] == 1, f"{name} is not split by input columns"
    _, start, stop = part
    block = block_format(qtype).block_weights
    first, last = start // block * block, -(-stop // block) * block
    window = read_checkpoint_part(checkpoint, f"{name}.weight", (1, first, last)).to(weight.dtype)
    weight.copy_(dequantize(quantize(window, qtype))[:, start - first : stop - first])
