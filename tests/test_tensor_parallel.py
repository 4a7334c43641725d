"""Tensor parallelism on the CPU (gloo): TP=N gives TP=1's tokens and logprobs, and a lost rank ends every rank.

The TP engines here run rank 0 in the test process (LLMEngine) or in a core process (AsyncEngine), and start
their other ranks as processes; every test checks that none is left behind.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import pytest
import torch
import transformers

from pagedserve.engine import LLM, EngineConfig, EngineUnavailableError, SamplingParams
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.worker.models import ModelSpec
from tests.servers import free_port, wait_ready

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
LOGPROB_TOLERANCE = 1e-4  # float32 rounding: the ranks' partial sums add up in another order than one matmul
STARTUP_SECONDS = 180


def worker_processes() -> list[psutil.Process]:
    """Every tensor-parallel rank process below this one (rank 0 may be a core process in between)."""
    return [
        p for p in psutil.Process().children(recursive=True) if "pagedserve.engine.worker.distributed.rank" in _cmd(p)
    ]


def _cmd(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def wait_gone(processes: list[psutil.Process], timeout: float = 30.0) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return not alive


@pytest.fixture(autouse=True)
def no_rank_left_behind() -> Iterator[None]:
    yield
    assert wait_gone(worker_processes()), "a tensor-parallel rank outlived its engine"


def engine_for(model_dir: Path, tensor_parallel_size: int, **overrides: object) -> LLMEngine:
    settings: dict = dict(num_kv_blocks=64, max_model_len=256, num_threads=1, quantization="none")
    settings.update(overrides)
    config = EngineConfig(model=str(model_dir), tensor_parallel_size=tensor_parallel_size, **settings)
    return LLMEngine(config)


Result = dict[str, tuple[list[int], list[float]]]  # "request/index" -> (tokens, their logprobs)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> Result:
    for request_id, (token_ids, params) in requests.items():
        engine.add_request(request_id, token_ids, params)
    out: Result = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.error is None, delta.error
            tokens, logprobs = out.setdefault(f"{delta.request_id}/{delta.index}", ([], []))
            tokens += delta.new_token_ids
            logprobs += [lp.logprob for lp in delta.new_logprobs or []]
            if delta.prompt_logprobs:
                logprobs += [lp.logprob for lp in delta.prompt_logprobs if lp is not None]
    return out


def workload(engine: LLMEngine) -> Result:
    """Chunked prefill, preemption and recompute, prompt logprobs, copy-on-write, then prefix-cache hits."""
    first = {f"r{i}": (list(range(100 + 70 * i, 160 + 70 * i)), replace(GREEDY, max_tokens=16 + i)) for i in range(5)}
    first["scored"] = (list(range(2000, 2040)), replace(GREEDY, prompt_logprobs=2))
    first["n"] = (list(range(3000, 3037)), SamplingParams(n=3, max_tokens=6, seed=3, logprobs=1))
    out = run(engine, first)
    again = {"hit": (list(range(100, 160)) + [7, 8, 9], GREEDY)}  # r0's prompt, cached, then 3 new tokens
    out |= run(engine, again)
    snapshot = engine.snapshot()
    assert snapshot.num_preemptions > 0 and snapshot.prefix_cache_hits > 0
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    return out


def assert_same(expected: Result, actual: Result) -> None:
    assert actual.keys() == expected.keys()
    for key, (tokens, logprobs) in expected.items():
        assert actual[key][0] == tokens, key
        assert actual[key][1] == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE), key


def run_alone(engine: LLMEngine, job: Callable[[LLMEngine], Result]) -> Result:
    try:
        return job(engine)
    finally:
        engine.close()


TIGHT = dict(num_kv_blocks=24, max_num_batched_tokens=32)  # preempts, and prefills in chunks


@pytest.mark.parametrize(
    ("family", "size"),
    [
        ("llama", 2),
        ("qwen2", 2),  # q/k/v biases; a tied LM head
        ("mistral", 2),
        pytest.param("llama", 4, marks=pytest.mark.slow),  # 2 KV heads over 4 ranks: each replicated twice
        pytest.param("qwen2", 4, marks=pytest.mark.slow),
    ],
)
def test_split_model_matches_the_whole_one(family: str, size: int, tiny_model_dir: Callable[[str], Path]) -> None:
    folder = tiny_model_dir(family)
    expected = run_alone(engine_for(folder, 1, **TIGHT), workload)
    split = engine_for(folder, size, **TIGHT)
    assert split.collect_stats().tensor_parallel_size == size
    actual = run_alone(split, workload)
    assert_same(expected, actual)


@pytest.mark.slow
def test_smollm2_over_three_ranks_matches_one(smol_dir: Path) -> None:
    """9 query heads and 3 KV heads: 3 and 1 per rank."""
    requests = {
        "a": (list(range(200, 230)), GREEDY),
        "b": (list(range(5000, 5007)), GREEDY),
    }
    expected = run_alone(engine_for(smol_dir, 1), lambda e: run(e, requests))
    engine = engine_for(smol_dir, 3)
    try:
        actual = run(engine, requests)
        stats = engine.collect_stats()
        assert 0 < stats.communication_seconds < stats.forward_seconds
    finally:
        engine.close()
    assert_same(expected, actual)


def test_head_counts_that_do_not_split_are_refused_with_the_sizes_that_work(smol_dir: Path) -> None:
    spec = ModelSpec.from_hf_config(transformers.AutoConfig.from_pretrained(smol_dir))
    assert spec.tensor_parallel_sizes() == [1, 3]
    message = "num_attention_heads 9, num_key_value_heads 3 not divisible by it; sizes that work: 1, 3"
    with pytest.raises(ValueError, match=message):
        engine_for(smol_dir, 2)
    assert spec.for_rank(3).num_heads == 3 and spec.for_rank(3).num_kv_heads == 1
    assert [spec.first_kv_head(rank, 3) for rank in range(3)] == [0, 1, 2]


def test_every_quantization_is_accepted_with_tensor_parallelism() -> None:
    """Each rank keeps its shards in blocks (tests/test_tensor_parallel_quantized.py)."""
    for quantization in ("auto", "none", "q8_0", "q4_k"):
        assert EngineConfig(tensor_parallel_size=2, quantization=quantization).quantization == quantization
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_a_rank_killed_mid_generation_ends_the_engine_and_every_process(tiny_model_dir) -> None:
    config = EngineConfig(model=str(tiny_model_dir("llama")), num_kv_blocks=64, num_threads=1, tensor_parallel_size=2)
    engine = AsyncEngine.from_config(config).start()
    died: list[bool] = []
    engine.on_death(lambda: died.append(True))
    try:
        assert engine.wait_ready(STARTUP_SECONDS), engine.unavailable_reason()
        core = psutil.Process(engine.info.pid)
        (rank1,) = worker_processes()

        async def stream_then_kill() -> None:
            stream = await engine.generate("doomed", [5, 6, 7], SamplingParams(max_tokens=1000, ignore_eos=True))
            await anext(stream)
            rank1.send_signal(signal.SIGKILL)
            with pytest.raises(EngineUnavailableError, match="rank 1"):
                async for _ in stream:
                    pass

        start = time.monotonic()
        asyncio.run(stream_then_kill())
        assert time.monotonic() - start < 30
        deadline = time.monotonic() + 10  # the death callbacks run on the engine's thread, maybe after the stream
        while not died and time.monotonic() < deadline:
            time.sleep(0.05)
        assert died == [True] and not engine.is_healthy
        assert "tensor-parallel rank 1 exited (killed by signal SIGKILL)" in engine.unavailable_reason()
    finally:
        engine.shutdown()
    assert wait_gone([core])


def test_the_other_ranks_exit_when_rank_0_is_killed(tiny_model_dir) -> None:
    config = EngineConfig(model=str(tiny_model_dir("llama")), num_kv_blocks=64, num_threads=1, tensor_parallel_size=2)
    engine = AsyncEngine.from_config(config).start()
    try:
        assert engine.wait_ready(STARTUP_SECONDS), engine.unavailable_reason()
        ranks = worker_processes()
        psutil.Process(engine.info.pid).send_signal(signal.SIGKILL)  # no chance to stop them
        assert wait_gone(ranks, timeout=10)
    finally:
        engine.shutdown()


def test_a_rank_killed_while_loading_fails_the_start_quickly(tiny_model_dir) -> None:
    config = EngineConfig(model=str(tiny_model_dir("qwen2")), num_kv_blocks=64, num_threads=1, tensor_parallel_size=2)
    engine = AsyncEngine.from_config(config).start()
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while not (ranks := worker_processes()) and time.monotonic() < deadline:
            time.sleep(0.01)
        ranks[0].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        assert not engine.wait_ready(30)
        assert time.monotonic() - killed < 30
        assert "tensor-parallel rank 1 exited" in engine.unavailable_reason()
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_a_hung_rank_is_noticed_and_killed(tiny_model_dir) -> None:
    engine = engine_for(tiny_model_dir("llama"), 2)
    try:
        (rank1,) = worker_processes()
        rank1.send_signal(signal.SIGSTOP)
        engine.add_request("a", [5, 6, 7], GREEDY)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 stopped responding"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 30
    finally:
        engine.close()


@pytest.mark.slow
def test_the_server_flag_splits_the_model_and_a_lost_rank_stops_the_server(tiny_model_dir) -> None:
    model = str(tiny_model_dir("llama"))
    messages = [{"role": "user", "content": "Name three colours."}]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(model=model, num_kv_blocks=64, engine_process=False) as llm:
        expected = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    port = free_port()
    flags = ["--port", str(port), "--tensor-parallel-size", "2", "--num-kv-blocks", "64", "--num-threads", "1"]
    command = [sys.executable, "-m", "pagedserve.server.cli", "serve", model, *flags]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_ready(server, url, STARTUP_SECONDS)
        body = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == expected
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert re.search(r'^pagedserve:tensor_parallel_size\{model_name="[^"]*"\} 2\.0$', metrics, re.M), metrics
        spent = re.search(r"^pagedserve:tensor_parallel_communication_seconds_total\{.*\} (\S+)$", metrics, re.M)
        assert spent is not None and float(spent.group(1)) > 0
        everything = psutil.Process(server.pid).children(recursive=True)  # the core and rank 1
        (rank1,) = worker_processes()
        rank1.send_signal(signal.SIGKILL)
        assert server.wait(30) == 1  # unhealthy, drained, exited: an orchestrator restarts it
        assert wait_gone(everything)
    finally:
        server.kill()


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2 or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs two CUDA devices and compiled Triton kernels",
)
def test_two_gpus_with_decode_graphs_match_one(tiny_model_dir: Callable[[str], Path]) -> None:
    """NCCL between the ranks, Triton kernels and recorded decode graphs (their all-reduces inside) per rank."""
    folder = tiny_model_dir("llama-hd64")
    cuda = dict(device="cuda", dtype="float32", max_num_seqs=8)
    requests = {f"r{i}": (list(range(100 + 40 * i, 140 + 40 * i)), GREEDY) for i in range(4)}
    expected = run_alone(engine_for(folder, 1, enforce_eager=True, **cuda), lambda e: run(e, requests))
    engine = engine_for(folder, 2, **cuda)
    try:
        actual = run(engine, requests)
        graphs = engine.runner.decode_graphs
        assert graphs is not None and graphs.num_replays > 0
    finally:
        engine.close()
    assert_same(expected, actual)
