"""`pagedserve bench serve`: seeded workloads, arrival times, metric maths, and runs against real and mock servers."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import transformers

from pagedserve.engine import EngineConfig
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings, cli
from pagedserve.server.benchmark import BenchmarkConfig, run_benchmark, run_benchmark_async
from pagedserve.server.benchmark.arrivals import inter_arrival_delays
from pagedserve.server.benchmark.client import RequestRecord
from pagedserve.server.benchmark.command import config_from_args, parse_slos, serve_command
from pagedserve.server.benchmark.metrics import distribution_ms, peak_concurrency, summarize
from pagedserve.server.benchmark.report import format_table
from pagedserve.server.benchmark.workloads import (
    PREFIX_WORDS,
    Tokenizer,
    build_requests,
    count_tokens,
    sharegpt_like_lengths,
)
from tests.servers import served_engine

MODEL = "tiny"
TOLERANCE = 2  # tokens: cutting the token ids and re-encoding the text can merge or split one at the cut


@pytest.fixture(scope="module")
def tokenizer(smol_dir: Path) -> Tokenizer:
    return transformers.AutoTokenizer.from_pretrained(smol_dir)


def config(**overrides: Any) -> BenchmarkConfig:
    return BenchmarkConfig(**{"num_prompts": 6, "input_len": 48, "output_len": 8, "disable_tqdm": True, **overrides})


def first_words(text: str) -> str:
    return " ".join(text.split()[:PREFIX_WORDS])


# Workloads


@pytest.mark.parametrize("workload", ["random", "sharegpt-like", "shared-prefix"])
def test_a_seed_and_nonce_give_the_same_requests(tokenizer: Tokenizer, workload: str) -> None:
    cfg = config(workload=workload, prefix_len=40, max_model_len=512)
    assert build_requests(cfg, tokenizer, "n1") == build_requests(cfg, tokenizer, "n1")


def test_random_prompts_have_the_requested_token_count(tokenizer: Tokenizer) -> None:
    requests = build_requests(config(input_len=100, output_len=7), tokenizer, "n")
    assert len(requests) == 6
    for request in requests:
        assert request.prompt_len == count_tokens(tokenizer, request.prompt)
        assert abs(request.prompt_len - 100) <= TOLERANCE and request.output_len == 7 and request.system is None


def test_sharegpt_like_lengths_follow_the_seeded_law(tokenizer: Tokenizer) -> None:
    cfg = config(workload="sharegpt-like", num_prompts=20, max_model_len=512, seed=3)
    requests = build_requests(cfg, tokenizer, "n")
    expected = sharegpt_like_lengths(20, 512, seed=3)
    assert [r.output_len for r in requests] == [output for _, output in expected]
    for request, (prompt_len, output_len) in zip(requests, expected):
        assert abs(request.prompt_len - prompt_len) <= TOLERANCE
        assert request.prompt_len + output_len <= 512 + TOLERANCE
    assert len({r.prompt_len for r in requests}) > 5  # long-tailed, not constant


def test_every_run_and_request_gets_its_own_prefix(tokenizer: Tokenizer) -> None:
    run_a = build_requests(config(), tokenizer, "run-a")
    run_b = build_requests(config(), tokenizer, "run-b")
    prefixes = [first_words(r.prompt) for r in run_a + run_b]
    assert len(set(prefixes)) == len(prefixes)
    assert all(len(prefix.split()) == PREFIX_WORDS for prefix in prefixes)


def test_shared_prefix_requests_share_one_system_prompt_per_run(tokenizer: Tokenizer) -> None:
    cfg = config(workload="shared-prefix", prefix_len=200, input_len=20)
    requests = build_requests(cfg, tokenizer, "run-a")
    [system] = {r.system for r in requests}
    assert system is not None and abs(count_tokens(tokenizer, system) - 200) <= TOLERANCE
    assert len({first_words(r.prompt) for r in requests}) == len(requests)  # the questions still differ
    for request in requests:
        assert abs(request.prompt_len - 220) <= 2 * TOLERANCE
    [other_run] = {r.system for r in build_requests(cfg, tokenizer, "run-b")}
    assert other_run != system  # shared within a run, not across runs


def sharegpt_file(tmp_path: Path) -> Path:
    def turn(speaker: str, text: str) -> dict[str, str]:
        return {"from": speaker, "value": text}

    conversations: list[dict[str, Any]] = [
        {"conversations": [turn("human", f"question {i} " + "word " * i), turn("gpt", "a " * (10 + i))]}
        for i in range(8)
    ]
    conversations += [
        {"conversations": [turn("gpt", "a reply with no question")]},
        {"conversations": [turn("human", "a question with"), turn("gpt", "no")]},  # too short
        {"id": "no turns"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    return path


def test_a_sharegpt_file_gives_first_questions_and_reply_lengths(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = sharegpt_file(tmp_path)
    requests = build_requests(config(dataset_path=str(path), num_prompts=8), tokenizer, "n")
    replies = {count_tokens(tokenizer, "a " * (10 + i)) for i in range(8)}
    assert {r.output_len for r in requests} == replies
    assert all("question" in r.prompt and r.prompt_len == count_tokens(tokenizer, r.prompt) for r in requests)
    with pytest.raises(ValueError, match="8 usable conversations"):
        build_requests(config(dataset_path=str(path), num_prompts=9), tokenizer, "n")


# Arrivals


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_arrivals_have_the_requested_mean_rate(burstiness: float) -> None:
    delays = inter_arrival_delays(20_000, request_rate=10.0, burstiness=burstiness, seed=1)
    assert statistics.fmean(delays) == pytest.approx(0.1, rel=0.05)
    cv_squared = statistics.variance(delays) / statistics.fmean(delays) ** 2
    assert cv_squared == pytest.approx(1 / burstiness, rel=0.1)  # lower burstiness: more clustered


def test_an_infinite_rate_sends_everything_at_once() -> None:
    assert inter_arrival_delays(3, float("inf"), 1.0, seed=0) == [0.0, 0.0, 0.0]


# Metrics


def record(send: float, chunks: list[float], finish: float, tokens: int, **fields: Any) -> RequestRecord:
    return RequestRecord(send, finish, chunks, "x", prompt_tokens=10, output_tokens=tokens, success=True, **fields)


def failure(send: float, finish: float, status: int | None, error: str) -> RequestRecord:
    return RequestRecord(send, finish, status=status, error=error)


def test_distributions_use_linear_percentiles() -> None:
    stats = distribution_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats == pytest.approx({"mean": 50.5, "median": 50.5, "p90": 90.1, "p99": 99.01})
    assert distribution_ms([]) == {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}


def test_metrics_from_hand_made_records() -> None:
    records = [
        record(0.0, [0.1, 0.2, 0.4], 0.5, tokens=5),  # ttft 100, e2e 500, tpot 400/4 = 100, gaps 100 and 200
        record(0.2, [0.5, 0.6], 1.0, tokens=3),  # ttft 300, e2e 800, tpot 500/2 = 250, gap 100
        record(1.0, [1.05], 1.1, tokens=1),  # starts as the first ends: no tpot, no gap
        failure(0.3, 0.35, 503, "HTTP 503: the waiting queue is full"),
        failure(0.3, 0.4, None, "ConnectError: refused"),
    ]
    result = summarize(records, duration_s=2.0, slos_ms={"ttft": 200, "tpot": 150})
    assert (result["completed"], result["failed"], result["rejected_503"]) == (3, 2, 1)
    assert result["total_input_tokens"] == 30 and result["total_output_tokens"] == 9
    assert result["request_throughput"] == 1.5 and result["output_throughput"] == 4.5
    assert result["total_token_throughput"] == 19.5
    assert result["ttft_ms"]["mean"] == pytest.approx(150) and result["ttft_ms"]["median"] == pytest.approx(100)
    assert result["tpot_ms"]["mean"] == pytest.approx(175) and result["tpot_ms"]["p90"] == pytest.approx(235)
    assert result["itl_ms"]["median"] == pytest.approx(100) and result["itl_ms"]["mean"] == pytest.approx(400 / 3)
    assert result["e2e_ms"]["mean"] == pytest.approx(1400 / 3) and result["e2e_ms"]["p99"] == pytest.approx(794)
    assert result["peak_concurrency"] == 4  # at 0.3: the first, second and both failures
    assert result["goodput"] == 1.0  # the first (ttft 100, tpot 100) and the third (ttft 50, no tpot): 2 in 2 s
    assert result["errors"] == ["HTTP 503: the waiting queue is full", "ConnectError: refused"]
    assert summarize(records, 2.0)["goodput"] is None  # no SLO given


def test_shedding_from_hand_made_records() -> None:
    records = [
        record(0.0, [0.1], 0.5, tokens=1),
        RequestRecord(0.1, 0.12, status=503, retry_after="1", error="HTTP 503: full"),  # refused after 20 ms
        RequestRecord(0.2, 0.26, status=503, error="HTTP 503: full"),  # refused after 60 ms, no Retry-After
        RequestRecord(0.3, 30.3, timed_out=True, error="ReadTimeout: "),
        RequestRecord(0.4, 5.0, status=504, error="HTTP 504: too slow"),
    ]
    result = summarize(records, duration_s=30.3)
    assert (result["rejected_503"], result["rejected_with_retry_after"], result["timeouts"]) == (2, 1, 2)
    assert result["first_rejection_ms"] == pytest.approx(120)  # from the first request sent
    assert result["rejection_ms"]["mean"] == pytest.approx(40)
    assert summarize(records[:1], 1.0)["first_rejection_ms"] is None


def test_peak_concurrency_counts_back_to_back_requests_once() -> None:
    chain = [record(t, [t + 0.5], t + 1.0, tokens=1) for t in range(5)]
    assert peak_concurrency(chain) == 1
    assert peak_concurrency([*chain, record(0.5, [2.0], 3.5, tokens=1)]) == 2


# Command line


def test_the_cli_builds_the_config() -> None:
    args = cli.build_parser().parse_args(
        ["bench", "serve", "--num-prompts", "3", "--request-rate", "2.5", "--endpoint-type", "completions",
         "--goodput", "ttft:500", "e2e:2000", "--no-ignore-eos", "--max-concurrency", "4"]
    )  # fmt: skip
    assert args.run is serve_command
    cfg = config_from_args(args)
    assert (cfg.num_prompts, cfg.request_rate, cfg.endpoint_type, cfg.max_concurrency) == (3, 2.5, "completions", 4)
    assert cfg.goodput == {"ttft": 500.0, "e2e": 2000.0} and cfg.ignore_eos is False
    assert config_from_args(cli.build_parser().parse_args(["bench", "serve"])).request_rate == float("inf")
    with pytest.raises(ValueError, match="METRIC:MS"):
        parse_slos(["latency:5"])


# Runs


@pytest.fixture(scope="module")
def url(tiny_llama_loaded: LoadedModel) -> Iterator[str]:
    config = EngineConfig(num_kv_blocks=128, max_num_seqs=8)
    with served_engine(config, tiny_llama_loaded, ServerSettings([MODEL])) as url:
        yield url


@pytest.mark.parametrize(
    "endpoint_type, load",
    [("chat", {}), ("completions", {"request_rate": 50.0, "max_concurrency": 2})],
)
def test_a_run_against_a_real_server(
    url: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path, endpoint_type: str, load: dict[str, Any]
) -> None:
    cfg = config(base_url=url, endpoint_type=endpoint_type, tokenizer=str(tiny_model_dir("llama")), **load)
    result = run_benchmark(cfg)
    assert (result["completed"], result["failed"], result["rejected_503"]) == (6, 0, 0), result["errors"]
    assert result["model"] == MODEL and result["total_output_tokens"] == 6 * 8
    assert 0 < result["ttft_ms"]["mean"] <= result["e2e_ms"]["mean"]
    assert result["ttft_ms"]["p99"] <= result["e2e_ms"]["p99"] and result["tpot_ms"]["mean"] > 0
    assert 1 <= result["peak_concurrency"] <= load.get("max_concurrency", 6)
    assert "api_key" not in result["config"] and result["config"]["endpoint_type"] == endpoint_type
    saved = tmp_path / "result.json"
    saved.write_text(json.dumps(result))
    assert json.loads(saved.read_text()) == result
    assert "Successful requests:" in format_table(result)


def test_the_command_prints_the_table_and_saves_the_result(
    url: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "result.json"
    argv = ["bench", "serve", "--base-url", url, "--num-prompts", "2", "--input-len", "16", "--output-len", "4",
            "--tokenizer", str(tiny_model_dir("llama")), "--goodput", "e2e:60000", "--disable-tqdm",
            "--save-result", str(saved)]  # fmt: skip
    assert serve_command(cli.build_parser().parse_args(argv)) == 0
    assert "Goodput (req/s)" in capsys.readouterr().out
    result = json.loads(saved.read_text())
    assert result["completed"] == 2 and result["goodput"] > 0 and result["config"]["goodput"] == {"e2e": 60000.0}


def sse(*chunks: dict[str, Any] | str) -> bytes:
    return "".join(f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n" for c in chunks).encode()


class MockServer:
    """Answers in turn: a full stream without usage, a 503, a stream that fails midway (the warm-up is first)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self._turn = itertools.count()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "mock"}]})
        assert request.headers["authorization"] == "Bearer secret"
        self.bodies.append(json.loads(request.content))
        text = {"choices": [{"index": 0, "delta": {"content": "hello world"}}]}
        turn = next(self._turn) % 3
        if turn == 1:
            return httpx.Response(503, json={"error": {"message": "the waiting queue is full", "code": "queue_full"}})
        if turn == 2:
            body = sse(text, {"error": {"message": "the engine failed", "code": "internal_error"}})
        else:
            body = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, text, text, "[DONE]")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})


def test_rejections_and_broken_streams_are_counted_not_raised(tokenizer: Tokenizer, smol_dir: Path) -> None:
    server = MockServer()
    cfg = config(base_url="http://mock", tokenizer=str(smol_dir), api_key="secret")
    result = asyncio.run(run_benchmark_async(cfg, transport=httpx.MockTransport(server)))
    assert (result["completed"], result["failed"], result["rejected_503"]) == (2, 4, 2)
    assert sorted(result["errors"]) == ["HTTP 503: the waiting queue is full", "the engine failed"]
    # No usage chunk: the output is counted by tokenizing the text; the prompt keeps the workload's count.
    assert result["total_output_tokens"] == 2 * count_tokens(tokenizer, "hello worldhello world")
    assert result["model"] == "mock" and len(server.bodies) == 7  # the warm-up, then six
    body = server.bodies[-1]
    assert body["model"] == "mock" and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["temperature"], body["ignore_eos"]) == (8, 0, True)
    assert body["messages"][0]["role"] == "user"
