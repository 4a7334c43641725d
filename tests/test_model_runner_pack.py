"""ModelRunner.pack: a decode step's inputs from the plain-list fast path equal the general path's."""

from __future__ import annotations

import dataclasses

import torch

from pagedserve.engine import SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.worker.model_loader import LoadedModel
from tests.test_engine import prompt


def test_a_decode_batch_packs_as_the_general_path_packs_it(tiny_llama_loaded: LoadedModel) -> None:
    config = EngineConfig(model=str(tiny_llama_loaded.model_dir), num_kv_blocks=64, block_size=16)
    engine = LLMEngine(config, loaded=tiny_llama_loaded)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    # Prompts ending inside a block, on a block's last slot and past several blocks.
    for length, request_id in ((5, "short"), (31, "edge"), (47, "long")):
        engine.add_request(request_id, prompt(length, start=10), params)
    engine.step()  # the prefills
    engine.step()  # one decode each
    scheduled = engine.scheduler.schedule().scheduled
    assert len(scheduled) == 3 and all(s.num_new_tokens == 1 for s in scheduled)

    fast, general = engine.runner._pack_decode(scheduled), engine.runner._pack_any(scheduled)
    for field in dataclasses.fields(fast):
        ours, theirs = getattr(fast, field.name), getattr(general, field.name)
        if isinstance(theirs, torch.Tensor):
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), field.name
        else:
            assert ours == theirs, field.name
    assert engine.runner.pack(scheduled).positions.tolist() == [6, 32, 48]
