"""Tensor parallelism with block-format weights: each rank keeps its shards in blocks, and TP=N gives TP=1's
tokens and logprobs with the same blocks.

The shard checks load every rank's part of a model in this process (a group that is never asked to
communicate); the engine checks run ranks as processes over gloo, as tests/test_tensor_parallel.py does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.worker.distributed.group import Collectives, TensorParallelGroup
from pagedserve.engine.worker.model_loader import LoadedModel, load_model
from pagedserve.engine.worker.models import LlamaForCausalLM
from pagedserve.engine.worker.models.layers import Linear, QuantizedEmbedding, RowParallelLinear
from pagedserve.engine.worker.weights.block_shards import read_shard
from pagedserve.kernels.quantized import dequantize, quantize
from pagedserve.kernels.stacked_weight import ProjectionWeight, RowStackedWeight
from tests.test_kquants import write_tiny_gguf
from tests.test_tensor_parallel import (
    GREEDY,
    Result,
    assert_same,
    engine_for,
    run,
    run_alone,
    wait_gone,
    worker_processes,
)

CPU = torch.device("cpu")
REQUESTS = {
    "a": (list(range(200, 230)), GREEDY),
    "b": (list(range(1000, 1007)), GREEDY),
    "long": (list(range(300, 380)), GREEDY),  # a prefill of more than one block of tokens
}


@pytest.fixture(autouse=True)
def no_rank_left_behind() -> Iterator[None]:
    yield
    assert wait_gone(worker_processes()), "a tensor-parallel rank outlived its engine"


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Iterator[Path]:
    """tests/test_kquants.py's tiny Q4_K_M-style GGUF (hidden 256, MLP 512, mixed Q4_K/Q5_K/Q6_K/TQ2_0, a tied
    Q6_K head), converted into a cache folder of this module's own; the ranks inherit the variable."""
    folder = tmp_path_factory.mktemp("tp-q4_k_m")
    path = folder / "tiny-q4_k_m.gguf"
    write_tiny_gguf(path, smol_dir)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDSERVE_CACHE_DIR", str(folder / "cache"))
        yield path


def rank_group(rank: int, size: int) -> TensorParallelGroup:
    """A rank's place in a split that loading needs; it never communicates."""
    nobody = cast(Collectives, None)
    return TensorParallelGroup(rank, size, nobody, nobody, CPU)


def load_ranks(size: int, **settings: Any) -> list[LoadedModel]:
    return [load_model(EngineConfig(**settings), rank_group(rank, size)) for rank in range(size)]


def block_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of every weight the model keeps in blocks (a tied head's table counted once)."""
    projections = sum(m.quantized.nbytes for m in model.modules() if isinstance(m, Linear) and m.quantized)
    return projections + (model.quantized_head.nbytes if model.quantized_head is not None else 0)


def effective_weights(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Every projection's weight as it multiplies: its blocks dequantized, or its float weight."""
    weights = {
        name: dequantized(m.quantized) if m.quantized is not None else m.weight.data
        for name, m in model.named_modules()
        if isinstance(m, Linear)
    }
    if model.quantized_head is not None:
        weights["lm_head"] = dequantize(model.quantized_head)
    return weights


def dequantized(weight: ProjectionWeight) -> torch.Tensor:
    """A weight in blocks as float32, parts of different formats stacked by rows."""
    if isinstance(weight, RowStackedWeight):
        return torch.cat([dequantize(part) for part in weight.parts])
    return dequantize(weight)


def in_blocks(model: LlamaForCausalLM) -> set[str]:
    names = {name for name, m in model.named_modules() if isinstance(m, Linear) and m.quantized is not None}
    return names | ({"lm_head"} if model.quantized_head is not None else set())


# ---- one rank's shard of a weight in blocks -----------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["q4_1", "q6_k"])
def test_a_shard_is_the_whole_weights_rows_or_block_columns(qtype: str) -> None:
    whole = quantize(torch.randn(12, 512, generator=torch.Generator().manual_seed(0)), qtype)
    dense = dequantize(whole)
    stored = whole.blocks.numpy()
    rows = read_shard(stored, qtype, whole.shape, (0, 4, 9))
    assert torch.equal(dequantize(rows), dense[4:9])
    padded = read_shard(stored, qtype, whole.shape, (0, 8, 12), num_rows=6)  # the last rank of a padded vocabulary
    assert torch.equal(dequantize(padded), torch.cat([dense[8:12], torch.zeros(2, 512)]))
    order = np.arange(12)[::-1].copy()
    assert torch.equal(
        dequantize(read_shard(stored, qtype, whole.shape, (0, 0, 3), row_order=order)), dense[[11, 10, 9]]
    )
    columns = read_shard(stored, qtype, whole.shape, (1, 256, 512))
    assert columns.shape == (12, 256) and torch.equal(dequantize(columns), dense[:, 256:])
    with pytest.raises(ValueError, match="not whole blocks"):
        read_shard(stored, qtype, whole.shape, (1, 0, 128 if qtype == "q6_k" else 16))


# ---- every rank's shards, loaded in this process ----------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_ranks_keep_a_third_of_its_blocks_each(smol_loaded: LoadedModel, smol_dir: Path) -> None:
    """Q4_1 projections (o_proj's 192 and down_proj's 512 columns a rank: whole 32-weight blocks) and the tied
    Q8_0 head, sliced from the GGUF file: each rank's blocks are its float shards' values, a third of TP=1's."""
    ranks = load_ranks(3, model=str(smol_dir))
    whole = block_bytes(smol_loaded.model)
    for loaded in ranks:
        model = loaded.model
        assert in_blocks(model) == in_blocks(smol_loaded.model)  # every projection, and the head
        assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.embed_tokens.table is model.quantized_head
        assert block_bytes(model) == pytest.approx(whole / 3, rel=0.01)
    float_shard = load_model(EngineConfig(model=str(smol_dir), quantization="none"), rank_group(2, 3)).model
    expected = {**effective_weights(float_shard), "lm_head": float_shard.embed_tokens.weight.data}
    for name, weight in effective_weights(ranks[2].model).items():
        assert torch.equal(weight, expected[name]), name  # fused, un-permuted and sliced as transformers' floats


def test_k_quant_ranks_keep_their_blocks_and_slices_off_blocks_stay_float(
    tiny_q4_k_m: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Over 2 ranks o_proj's 128 columns a rank are half a 256-weight block: it stays float (the file's values,
    dequantized), named in one log line; down_proj's 256 columns split, and so do the mixed-type rows."""
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.worker.weights.gguf"):
        ranks = load_ranks(2, model=str(tiny_q4_k_m))
    whole = load_model(EngineConfig(model=str(tiny_q4_k_m))).model
    expected_blocks = in_blocks(whole) - {"layers.0.self_attn.o_proj"}  # layers.1's o_proj is TQ2_0: float anyway
    notes = [r.getMessage() for r in caplog.records if "row-parallel" in r.getMessage()]
    assert len(notes) == 2 and "Q4_K: layers.0.self_attn.o_proj" in notes[1] and "rank 1 of 2" in notes[1]
    o_proj = whole.get_submodule("layers.0.self_attn.o_proj")
    assert isinstance(o_proj, Linear) and o_proj.quantized is not None
    split_bytes = block_bytes(whole) - o_proj.quantized.nbytes
    for rank, loaded in enumerate(ranks):
        assert in_blocks(loaded.model) == expected_blocks
        assert block_bytes(loaded.model) == pytest.approx(split_bytes / 2, rel=0.01)
        assert_blocks_hold_the_float_shard(tiny_q4_k_m, loaded.model, rank, 2)


def test_k_quant_ranks_sharing_kv_heads_take_the_rows_of_theirs(tiny_q4_k_m: Path) -> None:
    """2 KV heads over 4 ranks: ranks 0-1 hold KV head 0's k and v rows, ranks 2-3 head 1's (as the float split
    does). o_proj's 64 and down_proj's 128 columns a rank are off the 256-weight blocks: both stay float."""
    whole = load_model(EngineConfig(model=str(tiny_q4_k_m))).model
    row_parallel = {f"layers.{i}.{m}" for i in range(2) for m in ("self_attn.o_proj", "mlp.down_proj")}
    for rank, loaded in enumerate(load_ranks(4, model=str(tiny_q4_k_m))):
        assert in_blocks(loaded.model) == in_blocks(whole) - row_parallel
        assert "layers.1.self_attn.qkv_proj" in in_blocks(loaded.model)
        assert_blocks_hold_the_float_shard(tiny_q4_k_m, loaded.model, rank, 4)


def assert_blocks_hold_the_float_shard(model_file: Path, model: LlamaForCausalLM, rank: int, size: int) -> None:
    """A rank's weights are its float shard's: the file's blocks dequantized, split as the float weights are."""
    float_shard = load_model(EngineConfig(model=str(model_file), quantization="none"), rank_group(rank, size)).model
    expected = {**effective_weights(float_shard), "lm_head": float_shard.embed_tokens.weight.data}
    for name, weight in effective_weights(model).items():
        assert torch.equal(weight, expected[name]), (rank, name)


def test_quantized_on_load_ranks_round_off_block_slices_as_the_whole_model(
    tiny_model_dir: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    """q4_k over 2 ranks of a hidden-256 Llama: o_proj's 128 columns a rank stay float, holding TP=1's blocks
    dequantized; down_proj (128 columns in all) is float at TP=1 too; the rest splits in blocks."""
    folder = str(tiny_model_dir("llama-hd64"))
    whole = load_model(EngineConfig(model=folder, quantization="q4_k")).model
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.worker.weights.on_load_quantization"):
        ranks = load_ranks(2, model=folder, quantization="q4_k")
    assert any(
        "layers.1.self_attn.o_proj" in r.getMessage() and "rank 1 of 2" in r.getMessage() for r in caplog.records
    )
    whole_weights = effective_weights(whole)
    for loaded in ranks:
        model, weights = loaded.model, effective_weights(loaded.model)
        assert in_blocks(model) == in_blocks(whole) - {f"layers.{i}.self_attn.o_proj" for i in range(2)}
        for name, module in model.named_modules():
            if isinstance(module, RowParallelLinear):
                part = model.checkpoint_slice(f"{name}.weight")
                assert part is not None
                assert torch.equal(weights[name], whole_weights[name][:, part[1] : part[2]]), name


def test_q8_0_on_load_ranks_hold_half_the_blocks_each(tiny_model_dir: Callable[[str], Path]) -> None:
    folder = str(tiny_model_dir("llama"))  # o_proj's 32 and down_proj's 64 columns a rank: whole blocks
    whole = load_model(EngineConfig(model=folder, quantization="q8_0")).model
    for loaded in load_ranks(2, model=folder, quantization="q8_0"):
        assert in_blocks(loaded.model) == in_blocks(whole)
        assert block_bytes(loaded.model) == pytest.approx(block_bytes(whole) / 2, rel=0.01)


# ---- ranks as processes: TP=N against TP=1 with the same blocks --------------------------------------------------


def matches_one_rank(model: Path, size: int, **settings: Any) -> None:
    """On float32 activations: integer ones round each rank's inputs, which differ from one rank's by float32
    rounding, to integers a step apart now and then, past LOGPROB_TOLERANCE."""
    settings = {"activation_dtype": "float32", **settings}

    def generate(engine: LLMEngine) -> Result:
        assert "lm_head" in in_blocks(engine.loaded.model)  # rank 0's shard (at least) multiplies in blocks
        return run(engine, REQUESTS)

    expected = run_alone(engine_for(model, 1, **settings), generate)
    actual = run_alone(engine_for(model, size, **settings), generate)
    assert_same(expected, actual)


def test_q8_0_on_load_over_two_ranks_matches_one(tiny_model_dir: Callable[[str], Path]) -> None:
    matches_one_rank(tiny_model_dir("llama"), 2, quantization="q8_0")


def test_q4_k_on_load_with_float_slices_over_two_ranks_matches_one(tiny_model_dir: Callable[[str], Path]) -> None:
    matches_one_rank(tiny_model_dir("llama-hd64"), 2, quantization="q4_k")


def test_k_quant_gguf_over_two_ranks_matches_one(tiny_q4_k_m: Path) -> None:
    matches_one_rank(tiny_q4_k_m, 2, quantization="auto")


@pytest.mark.slow
def test_k_quant_gguf_over_four_ranks_sharing_kv_heads_matches_one(tiny_q4_k_m: Path) -> None:
    matches_one_rank(tiny_q4_k_m, 4, quantization="auto")


@pytest.mark.slow
def test_smollm2_gguf_over_three_ranks_matches_one(smol_dir: Path) -> None:
    """The embedded Q4_1 file, its tied Q8_0 head looked up and multiplied as blocks on every rank."""
    matches_one_rank(smol_dir, 3, quantization="auto")
