"""Mixture-of-experts models served natively (Qwen3-MoE, Mixtral, OLMoE): greedy tokens equal transformers'
own generate through the offline API and through the server, with chunked prefill, preemption and a
prefix-cache hit in the mix; and the grouped expert product equals a dense per-token reference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.worker.model_loader import load_model
from pagedserve.engine.worker.models.moe_blocks import SparseMoeBlock
from pagedserve.kernels.quantized import dequantize, quantize
from pagedserve.server import ServerSettings
from tests.moe_models import MOE_CONFIGS, greedy_reference, save_moe_model
from tests.servers import served_engine

MAX_TOKENS = 12
# Five prompts of 40-80 tokens, then one that repeats the first's 48 tokens and goes on: a prefix-cache hit.
PROMPTS = [list(range(100 + 900 * i, 140 + 900 * i + 10 * i)) for i in range(5)]
HIT = [*PROMPTS[0], 7, 8, 9]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
TIGHT = dict(num_kv_blocks=20, max_num_batched_tokens=32, block_size=16)  # preempts, prefills in chunks


@pytest.fixture(scope="module", params=sorted(MOE_CONFIGS))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smol_dir: Path
) -> Iterator[tuple[str, Path, list[list[int]]]]:
    """(family, model folder, transformers' greedy tokens for PROMPTS then HIT)."""
    folder = tmp_path_factory.mktemp(request.param)
    model = save_moe_model(request.param, folder, smol_dir)
    reference = greedy_reference(model, [*PROMPTS, HIT], MAX_TOKENS)
    assert all(len(set(tokens)) > 3 for tokens in reference), "a model that repeats one token would test little"
    yield request.param, folder, reference


def test_layers_route_through_experts(family) -> None:
    name, folder, _ = family
    loaded = load_model(EngineConfig(model=str(folder)))
    blocks = [isinstance(layer.mlp, SparseMoeBlock) for layer in loaded.model.layers]
    assert blocks == ([True, False] if name == "qwen3_moe" else [True, True])  # Qwen3-MoE: mlp_only_layers=[1]


def test_attention_quantized_on_load_runs_on_the_modules_not_the_native_decoder(family) -> None:
    """q8_0 on load. Mixtral's layers (no q/k norm, projections in blocks) would otherwise be offered to the
    native CPU decoder, which has no routed layer."""
    _, folder, reference = family
    config = EngineConfig(model=str(folder), quantization="q8_0", num_kv_blocks=32, engine_process=False)
    loaded = load_model(config)
    assert loaded.model.layers[0].self_attn.qkv_proj.quantized is not None
    with LLM.from_config(config, loaded) as llm:
        got = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert loaded.model.native_decoder is None
    assert len(got) == MAX_TOKENS and got[:2] == reference[0][:2]  # q8_0 moves later tokens of a random model


ROUTERS = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")  # kept float: their logits pick and gate experts


def test_experts_quantized_on_load_match_transformers_on_the_dequantized_weights(family, tmp_path) -> None:
    """q8_0 on load: every projection and expert in blocks (the routers float); tokens equal transformers' on the
    weights those blocks dequantize to."""
    name, folder, _ = family
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() >= 2 and "embed_tokens" not in name and not name.endswith(ROUTERS):
                weight.copy_(
                    torch.stack([dequantize(quantize(w, "q8_0")) for w in weight.view(-1, *weight.shape[-2:])]).view_as(
                        weight
                    )
                )
    expected = greedy_reference(model, PROMPTS[:2], MAX_TOKENS)
    config = EngineConfig(model=str(folder), quantization="q8_0", num_kv_blocks=32, engine_process=False)
    loaded = load_model(config)
    experts = loaded.model.layers[0].mlp.experts
    assert experts.quantized is not None and experts.quantized.down[0].qtype == "q8_0"
    if name == "qwen2_moe":
        assert loaded.model.layers[0].mlp.shared_expert.gate_up_proj.quantized is not None
    with LLM.from_config(config, loaded) as llm:
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
    assert got == expected


def test_engine_with_chunks_preemption_and_prefix_hit_matches_transformers(family) -> None:
    _, folder, reference = family
    engine = LLMEngine(EngineConfig(model=str(folder), activation_dtype="float32", **TIGHT))
    tokens = run(engine, PROMPTS) + run(engine, [HIT])
    snapshot = engine.snapshot()
    assert snapshot.num_preemptions > 0 and snapshot.prefix_cache_hits > 0
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    assert tokens == reference


def test_offline_api_matches_transformers(family) -> None:
    _, folder, reference = family
    config = EngineConfig(model=str(folder), max_num_batched_tokens=32, engine_process=False)
    with LLM.from_config(config) as llm:
        got = [out.outputs[0].token_ids for out in llm.generate([*PROMPTS, HIT], GREEDY, use_tqdm=False)]
    assert got == reference


def test_server_matches_transformers(family) -> None:
    name, folder, reference = family
    config = EngineConfig(model=str(folder), **TIGHT)
    loaded = load_model(config)
    with served_engine(config, loaded, ServerSettings([name])) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt, expected in zip([*PROMPTS[:2], HIT], [*reference[:2], reference[-1]], strict=True):
            completion = client.completions.create(
                model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True}
            )
            assert completion.choices[0].token_ids == expected  # type: ignore[attr-defined]  # vLLM's field


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, GREEDY)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.error is None, delta.error
            tokens[delta.request_id].extend(delta.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]
