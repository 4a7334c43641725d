"""The Triton fused expert layer (kernels/triton_moe.py) against the per-token reference: on CPU tensors through
Triton's interpreter, or compiled on CUDA where there is a GPU. Small shapes: the interpreter is slow."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the kernels run in Triton's interpreter; this must precede triton's first import.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from tests.kernel_cases import triton_test_device
from tests.test_kernels_moe import per_token_reference

pytest.importorskip("triton")
triton_moe = pytest.importorskip("pagedserve.kernels.triton_moe")
DEVICE = triton_test_device(triton_moe._gate_up_kernel)
HIDDEN, INTER, EXPERTS, TOP_K = 64, 96, 6, 2  # 96: a partial column tile of the intermediate width


def test_tiles_hold_one_expert_each() -> None:
    ids = torch.tensor([[3, 0], [0, 2], [3, 2], [3, 1]])
    assignments, block_experts = triton_moe.align_by_expert(ids, num_experts=5, block_m=4)
    # expert 0: (0,0) (1,0) | expert 1: (3,1) | expert 2: (1,1) (2,1) | expert 3: (0,0) (2,0) (3,0) -> flat ids
    assert block_experts.tolist()[:4] == [0, 1, 2, 3] and set(block_experts.tolist()[4:]) <= {-1}
    runs = assignments.view(-1, 4).tolist()
    assert runs[:4] == [[1, 2, -1, -1], [7, -1, -1, -1], [3, 5, -1, -1], [0, 4, 6, -1]]


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_fused_experts_equal_per_token_reference(tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.1
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.1
    x = torch.randn(tokens, HIDDEN, generator=gen)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, EXPERTS, generator=gen), -1), TOP_K, dim=-1)
    expected = per_token_reference(x, ids, weights, gate_up, down)
    on = [t.to(DEVICE) for t in (x, ids, weights, gate_up, down)]
    got = triton_moe.fused_expert_product(*on)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-5)


def test_engine_on_the_triton_backend_matches_transformers(tmp_path, smol_dir) -> None:
    """A Qwen3-MoE (head_dim 64: the Triton attention's smallest) through the fused kernels, float32."""
    if DEVICE != "cpu":
        pytest.skip("the interpreted engine run; on CUDA the model tests run on the GPU backend")
    from pagedserve.engine import LLM, SamplingParams
    from tests.moe_models import greedy_reference, save_moe_model

    model = save_moe_model("qwen3_moe", tmp_path, smol_dir, head_dim=64)
    prompts = [list(range(100, 119)), list(range(300, 305))]
    expected = greedy_reference(model, prompts, max_tokens=4)
    llm = LLM(model=str(tmp_path), attention_backend="triton", num_kv_blocks=8, max_num_batched_tokens=8,
              engine_process=False)  # fmt: skip
    with llm:
        got = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in got] == expected
