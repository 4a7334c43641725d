"""The engine on the Triton backend (interpreted on CPU) generates what the CPU backend does."""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM, SamplingParams

triton = pytest.importorskip("triton")


def test_triton_backend_matches_cpu_backend_greedy(tiny_model_dir) -> None:
    folder = str(tiny_model_dir("llama-hd64"))
    # Two prompts of different lengths, prefilled in chunks next to a decode: mixed batches on both paths.
    prompts = [list(range(100, 119)), list(range(300, 305))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("cpu", "triton"):
        llm = LLM(
            model=folder, attention_backend=backend, num_kv_blocks=8, max_num_batched_tokens=8, engine_process=False
        )
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["triton"] == outputs["cpu"]
