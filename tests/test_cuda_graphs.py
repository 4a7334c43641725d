"""Decode graphs: batch sizes, padding, and replays that see every step input through the static buffers.

Without a GPU the graphs are recorded by `eager_capture`, which reruns the recorded forward on the buffers'
contents: a step input that bypassed the buffers would replay stale values and change the tokens. The real
CUDA capture is compared with eager execution in tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
from pagedserve.engine.worker.cuda_graphs import DecodeBuffers, eager_capture, graph_batch_sizes
from pagedserve.engine.worker.model_runner import StepInputs
from pagedserve.kernels import AttentionMetadata
from tests.test_engine import run

pytest.importorskip("triton")


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (128, [1, 2, 4, 8, 16, 32, 64, 128])],
)
def test_graph_batch_sizes_double_up_to_max_num_seqs(max_num_seqs: int, expected: list[int]) -> None:
    assert graph_batch_sizes(max_num_seqs) == expected


def _decode_step(seq_lens: list[int], block_tables: list[list[int]], block_size: int) -> StepInputs:
    n = len(seq_lens)
    slots = [table[(length - 1) // block_size] * block_size + (length - 1) % block_size
             for table, length in zip(block_tables, seq_lens)]  # fmt: skip
    metadata = AttentionMetadata(
        block_tables=torch.tensor(block_tables, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        block_size=block_size,
        query_lens_host=[1] * n,
        seq_lens_host=seq_lens,
    )
    return StepInputs(
        input_ids=torch.tensor([7, 8]), positions=torch.tensor(seq_lens) - 1, metadata=metadata,
        logits_indices=torch.arange(n),
    )  # fmt: skip


def test_buffers_hold_the_step_and_pad_with_rows_that_write_nothing() -> None:
    buffers = DecodeBuffers(max_batch=4, max_blocks_per_seq=3, device=torch.device("cpu"))
    buffers.load(_decode_step([20, 33], [[5, 6, 0], [2, 9, 4]], block_size=16), batch=4)
    buffers.load(_decode_step([17, 3], [[1, 3], [8, 0]], block_size=16), batch=4)  # narrower, shorter: overwrites
    assert buffers.input_ids.tolist() == [7, 8, 0, 0]
    assert buffers.positions.tolist() == [16, 2, 0, 0]
    assert buffers.slot_mapping[0].tolist() == [3 * 16 + 0, 8 * 16 + 2, -1, -1]
    assert buffers.seq_lens.tolist() == [17, 3, 1, 1]
    assert buffers.block_tables[0, :2, :2].tolist() == [[1, 3], [8, 0]]  # columns past the table are never read
    assert buffers.block_tables[0, 2:, 0].tolist() == [0, 0]
    (metadata,) = buffers.metadata(batch=2, block_size=16, planned_seq_len=48)
    assert metadata.is_decode_only and metadata.seq_lens_host == [48, 48]
    assert metadata.block_tables.data_ptr() == buffers.block_tables.data_ptr()


def test_decode_graphs_generate_what_eager_steps_do(tiny_model_dir) -> None:
    """Three sequences of different lengths leave one by one: replays at 3 (padded to 4), 2 (padded), 1."""
    folder = str(tiny_model_dir("llama-hd64"))
    prompts = [list(range(100, 113)), list(range(300, 305)), list(range(50, 71))]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 5, 7)]
    config = EngineConfig(model=folder, attention_backend="triton", num_kv_blocks=8, max_num_batched_tokens=16)
    eager, graphed = LLMEngine(config), LLMEngine(config)
    graphed.runner.capture_decode_graphs([1, 4], graphed.max_model_len, eager_capture)
    requests = {str(i): (prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))}
    expected = run(eager, requests)
    assert run(graphed, requests) == expected
    graphs = graphed.runner.decode_graphs
    assert graphs is not None and graphs.num_replays >= 6
    assert graphed.kv.pool.num_free == 8  # every block is back: padding rows never held one
