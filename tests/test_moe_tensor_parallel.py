"""Mixture-of-experts models split over tensor-parallel ranks (gloo, on the CPU): every rank holds every
expert's slice of the intermediate width, and TP=N gives TP=1's tokens and logprobs (chunked prefill,
preemption, prompt logprobs, n > 1 and prefix-cache hits in the mix); a GGUF's experts shard as blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from pagedserve.engine.worker.models.spec import ModelSpec
from tests.moe_models import save_moe_model
from tests.test_moe_gguf import write_gguf
from tests.test_tensor_parallel import (
    GREEDY,
    TIGHT,
    assert_same,
    engine_for,
    no_rank_left_behind,  # noqa: F401 (the autouse fixture: no rank outlives its engine)
    run,
    run_alone,
    workload,
)


@pytest.mark.parametrize(
    ("family", "size"),
    [
        ("qwen3_moe", 2),  # a dense layer beside the experts; per-head q/k norms
        ("qwen2_moe", 2),  # the shared expert's slice joins the routed sum before the one all-reduce
        ("mixtral", 2),
        ("olmoe", 2),  # q/k norms over the whole projections: their sums of squares all-reduced
        pytest.param("olmoe", 4, marks=pytest.mark.slow),  # 2 KV heads over 4 ranks: each replicated twice
    ],
)
def test_split_experts_match_the_whole_model(
    family: str, size: int, tmp_path_factory: pytest.TempPathFactory, smol_dir: Path
) -> None:
    folder = tmp_path_factory.mktemp(family)
    save_moe_model(family, folder, smol_dir)
    expected = run_alone(engine_for(folder, 1, **TIGHT), workload)
    split = engine_for(folder, size, **TIGHT)
    assert split.collect_stats().tensor_parallel_size == size
    assert_same(expected, run_alone(split, workload))


def test_experts_quantized_on_load_split_match_one_rank(tmp_path: Path, smol_dir: Path) -> None:
    """q8_0 on load: each rank quantizes its 32 of every expert's 64 columns of down: the whole model's blocks."""
    save_moe_model("qwen3_moe", tmp_path, smol_dir)
    settings = dict(TIGHT, quantization="q8_0", activation_dtype="float32")
    expected = run_alone(engine_for(tmp_path, 1, **settings), workload)
    assert_same(expected, run_alone(engine_for(tmp_path, 2, **settings), workload))


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_gguf_experts_split_as_blocks_match_one_rank(tmp_path: Path, smol_dir: Path, monkeypatch, arch: str) -> None:
    """Each rank reads every expert's 32 of 64 rows (gate/up) and columns (down): whole Q8_0 blocks (Qwen2-MoE's
    shared expert: 48 of its 96, its down projection's columns off blocks, so float)."""
    path = tmp_path / f"tiny-{arch}-q8_0.gguf"
    write_gguf(path, smol_dir, arch)
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    requests = {"a": (list(range(200, 230)), GREEDY), "b": (list(range(500, 507)), GREEDY)}
    settings = dict(quantization="gguf", activation_dtype="float32")
    expected = run_alone(engine_for(path, 1, **settings), lambda engine: run(engine, requests))
    assert_same(expected, run_alone(engine_for(path, 2, **settings), lambda engine: run(engine, requests)))


def test_sizes_that_do_not_split_the_experts_are_not_offered() -> None:
    """Qwen3-MoE's experts have a width of their own: a size that splits heads and the dense MLP but not it is
    neither listed nor accepted."""
    config = transformers.Qwen3MoeConfig(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=34, num_attention_heads=4, num_key_value_heads=4
    )
    spec = ModelSpec.from_hf_config(config)
    assert spec.tensor_parallel_sizes() == [1, 2]
    with pytest.raises(ValueError, match="moe_intermediate_size 34 not divisible by it; sizes that work: 1, 2"):
        spec.check_tensor_parallel(4)
