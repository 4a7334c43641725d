"""The decoder layers as one native call (engine/worker/native_decoder.py) against the model's modules: the same
kernels in the same order, so the same tokens and logprobs within float32 rounding (the modules keep a small
batch feature-major, and the norms then sum each token's features in another order). On float32 activations,
but for the tests of 8-bit ones at the end."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.kernels.quantized import integer_max_tokens
from pagedserve.kernels.stacked_weight import RowStackedWeight
from tests.conftest import TINY_COMMON
from tests.test_kquants import write_tiny_gguf

FLOAT32 = "float32"
PROMPTS = [list(range(100, 108)), list(range(300, 340)), list(range(1000, 1003))]
_ids = itertools.count()

Outputs = dict[int, tuple[list[int], list[float]]]


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 12) -> Outputs:
    """Greedy tokens and their logprobs, per prompt, all prompts in one batch."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, detokenize=False)
    ids = {f"r{next(_ids)}": i for i in range(len(prompts))}
    for request_id, i in ids.items():
        engine.add_request(request_id, prompts[i], params)
    out: Outputs = {i: ([], []) for i in ids.values()}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens, logprobs = out[ids[delta.request_id]]
            tokens += delta.new_token_ids
            logprobs += [entry.logprob for entry in delta.new_logprobs or []]
    return out


def both_ways(engine: LLMEngine, prompts: list[list[int]]) -> tuple[Outputs, Outputs]:
    model = engine.runner.model
    native = model.native_decoder
    assert native is not None, "the native forward should apply to this model"
    try:
        with_native = generate(engine, prompts)
        model.native_decoder = None
        with_modules = generate(engine, prompts)
    finally:
        model.native_decoder = native
    return with_native, with_modules


@pytest.mark.parametrize(
    ("family", "qtype"),
    [("llama", "q4_1"), ("llama", "q8_0"), ("qwen2", "q4_0"), ("mistral", "q4_1"), ("mistral-window", "q4_1")],
)
def test_native_forward_generates_what_the_modules_do(
    tiny_model_dir: Callable[[str], Path], family: str, qtype: str
) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir(family)), quantization=qtype, activation_dtype=FLOAT32))
    for prompts in [[prompt] for prompt in PROMPTS] + [PROMPTS]:  # one stream at a time, then a batch
        native, modules = both_ways(engine, prompts)
        for i in native:
            assert native[i][0] == modules[i][0]
            assert native[i][1] == pytest.approx(modules[i][1], abs=1e-4)


def test_native_forward_takes_chunked_prefill(tiny_model_dir: Callable[[str], Path]) -> None:
    """Chunks of 16 tokens: their rows go through the native forward too (the prompt of 40 through both)."""
    config = EngineConfig(model=str(tiny_model_dir("llama")), quantization="q4_1", max_num_batched_tokens=16)
    config = config.replace(activation_dtype=FLOAT32)
    engine = LLMEngine(config)
    native, modules = both_ways(engine, PROMPTS)
    assert {i: tokens for i, (tokens, _) in native.items()} == {i: tokens for i, (tokens, _) in modules.items()}


@pytest.mark.parametrize(("family", "quantization"), [("llama", "none"), ("qwen3", "q4_1")])
def test_native_forward_stands_aside_where_it_does_not_apply(
    tiny_model_dir: Callable[[str], Path], family: str, quantization: str
) -> None:
    """Float projections (not what it multiplies) and q/k norms (not what it computes) keep the modules."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir(family)), quantization=quantization))
    assert engine.runner.model.native_decoder is None
    assert len(generate(engine, PROMPTS[:1])[0][0]) == 12


@pytest.fixture(scope="module")
def k_quant_sized_llama(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    """A tiny random Llama whose projections' inputs are multiples of the K-quants' 256-weight blocks."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY_COMMON, "hidden_size": 256, "intermediate_size": 512})
    folder = tmp_path_factory.mktemp("tiny-llama-256")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(smol_dir).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k"])
def test_native_forward_takes_k_quants(k_quant_sized_llama: Path, qtype: str) -> None:
    engine = LLMEngine(EngineConfig(model=str(k_quant_sized_llama), quantization=qtype, activation_dtype=FLOAT32))
    native, modules = both_ways(engine, PROMPTS)
    for i in native:
        assert native[i][0] == modules[i][0]
        assert native[i][1] == pytest.approx(modules[i][1], abs=1e-4)


@pytest.fixture(scope="module")
def mixed_qkv_gguf(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Iterator[Path]:
    """A tiny Llama GGUF whose v projections are Q6_K and the rest Q4_K, as in a Q4_K_M file."""
    folder = tmp_path_factory.mktemp("mixed-qkv")
    path = folder / "tiny-mixed-qkv.gguf"
    write_tiny_gguf(path, smol_dir, {"blk.0.attn_v": "Q6_K", "blk.1.attn_v": "Q6_K", "token_embd": "Q6_K"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDSERVE_CACHE_DIR", str(folder / "cache"))
        yield path


def test_native_forward_takes_q_k_v_of_different_formats(mixed_qkv_gguf: Path) -> None:
    """q and k in Q4_K, v in Q6_K: three products into one output, in the native call as in the modules."""
    engine = LLMEngine(EngineConfig(model=str(mixed_qkv_gguf), activation_dtype=FLOAT32))
    qkv = engine.runner.model.layers[0].self_attn.qkv_proj.quantized
    assert isinstance(qkv, RowStackedWeight) and [part.qtype for part in qkv.parts] == ["q4_k", "q4_k", "q6_k"]
    native, modules = both_ways(engine, PROMPTS)
    for i in native:
        assert native[i][0] == modules[i][0]
        assert native[i][1] == pytest.approx(modules[i][1], abs=1e-4)


# --- 8-bit activations --------------------------------------------------------------------------------------


def assert_integer_path_follows_the_modules(config: EngineConfig) -> None:
    """Both paths on integer activations: the same tokens, and logprobs as close as the roundings of x allow
    (decided on float32 inputs that differ by rounding between the paths, one may land a step apart). And not the
    float32 path's logprobs (an engine of its own: int16 may have laid Q4_0 out for its kernel alone,
    engine/worker/kernel_layouts.py): the native forward does quantize. As many prompts as decode steps of fewer
    than integer_max_tokens(dtype) tokens allow (int8: two; int16: all three)."""
    dtype = config.activation_dtype
    engine = LLMEngine(config)
    decoder = engine.runner.model.native_decoder
    assert decoder is not None and decoder.int8_max_tokens == integer_max_tokens(dtype)
    prompts = PROMPTS[: integer_max_tokens(dtype) - 1]
    native, modules = both_ways(engine, prompts)
    float32, _ = both_ways(LLMEngine(config.replace(activation_dtype=FLOAT32)), prompts)
    for i in native:
        assert native[i][0] == modules[i][0]
        assert native[i][1] == pytest.approx(modules[i][1], abs=1e-2 if dtype == "int8" else 1e-4)
        assert native[i][1] != pytest.approx(float32[i][1], abs=1e-7)


@pytest.mark.parametrize("dtype", ["int8", "int16"])
@pytest.mark.parametrize(("family", "qtype"), [("llama", "q4_0"), ("qwen2", "q8_0"), ("mistral", "q4_1")])
def test_native_forward_takes_integer_activations(
    tiny_model_dir: Callable[[str], Path], family: str, qtype: str, dtype: str
) -> None:
    assert_integer_path_follows_the_modules(
        EngineConfig(model=str(tiny_model_dir(family)), quantization=qtype, activation_dtype=dtype)
    )


@pytest.mark.parametrize("dtype", ["int8", "int16"])
@pytest.mark.parametrize("qtype", ["q4_k", "q6_k"])
def test_native_forward_takes_integer_activations_with_k_quants(
    k_quant_sized_llama: Path, qtype: str, dtype: str
) -> None:
    assert_integer_path_follows_the_modules(
        EngineConfig(model=str(k_quant_sized_llama), quantization=qtype, activation_dtype=dtype)
    )


def test_smollm2_decodes_eight_streams_on_int16_tiles_as_on_float32() -> None:
    """The embedded SmolLM2 (its GGUF as stored), eight streams: decode steps of eight tokens, one whole tile of
    csrc/int16_dot.c, on 16-bit activations give the float32 path's greedy tokens, with logprobs within x's
    rounding but not equal to them (the integer kernels did run)."""
    engine = LLMEngine(EngineConfig(activation_dtype="int16"))
    decoder = engine.runner.model.native_decoder
    assert decoder is not None and decoder.int8_max_tokens > 8
    prompts = [list(range(200 + 37 * i, 206 + 41 * i)) for i in range(8)]
    int16 = generate(engine, prompts)
    engine.runner.model.backend.activation_dtype = FLOAT32
    decoder.int8_max_tokens = 0
    float32 = generate(engine, prompts)
    for i in int16:
        assert int16[i][0] == float32[i][0]
        assert int16[i][1] == pytest.approx(float32[i][1], abs=2e-2)
        assert int16[i][1] != pytest.approx(float32[i][1], abs=1e-7)
