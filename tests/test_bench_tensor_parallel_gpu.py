"""benchmarks/tensor_parallel_gpu.py without a GPU: the model it writes, the refusal, the ratio column."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from benchmarks import tensor_parallel_gpu as bench
from pagedserve.engine.text.hf_tokenizer import load_tokenizer
from pagedserve.engine.worker.models.spec import ModelSpec


def test_the_written_model_is_llama3_8b_shaped_and_splits_over_two(tmp_path: Path) -> None:
    folder = bench.write_llama3_8b_shape(tmp_path, layers=2)
    spec = ModelSpec.from_hf_config(transformers.AutoConfig.from_pretrained(folder))
    assert (spec.architecture, spec.hidden_size, spec.num_layers) == ("LlamaForCausalLM", 4096, 2)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 8, 128)
    assert (spec.intermediate_size, spec.vocab_size, spec.tie_word_embeddings) == (14336, 128256, False)
    assert spec.rope_parameters["rope_theta"] == 500000.0
    half = spec.for_rank(2)
    assert (half.num_heads, half.num_kv_heads, half.intermediate_size) == (16, 4, 7168)
    assert load_tokenizer(folder) is not None  # the engine can load the folder's placeholder tokenizer


@pytest.mark.parametrize(
    ("sizes", "gpus", "message"),
    [
        ([1, 2], 0, "TP=2 needs 2 GPUs; this machine has 0"),
        ([2, 1], 1, "TP=2 needs 2 GPUs; this machine has 1"),
        ([1, 2, 4], 2, "TP=4 needs 4 GPUs; this machine has 2"),
        ([1], 0, "TP=1 needs 1 GPU; this machine has 0"),
        ([1, 2], 2, None),
    ],
)
def test_the_largest_size_decides_whether_it_runs(sizes: list[int], gpus: int, message: str | None) -> None:
    assert bench.missing_gpus_message(sizes, gpus) == message


def test_too_few_gpus_measures_nothing(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(bench, "visible_gpus", lambda: 1)
    monkeypatch.setattr(bench, "run_table", lambda *args: pytest.fail("measured with too few GPUs"))
    bench.main(["--sizes", "1", "2"])
    assert capsys.readouterr().out == "tensor_parallel_gpu: TP=2 needs 2 GPUs; this machine has 1; nothing measured\n"


def test_ratio_is_against_tp1_at_the_same_streams() -> None:
    baseline = {64: 2000.0, 1: 50.0}
    assert bench.table_row(bench.Measurement(2, 64, 3000.0, 0.015), baseline) == "| 2 | 64 | 3000.0 | 1.50x | 1.5% |"
    assert bench.table_row(bench.Measurement(2, 1, 80.0, 0.0), baseline) == "| 2 | 1 | 80.0 | 1.60x | 0.0% |"
    assert bench.table_row(bench.Measurement(2, 8, 80.0, 0.0), baseline) == "| 2 | 8 | 80.0 | - | 0.0% |"
