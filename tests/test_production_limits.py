"""Queue places per sequence, time limits (408, 503, 504 and their error events), body size, the request log."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator

import httpx
import pytest

from pagedserve.engine import EngineConfig
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings, cli
from pagedserve.server.logs import JsonFormatter
from tests.servers import running_engine, serving

MODEL = "smol"
HELLO = [{"role": "user", "content": "Hi"}]
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
SHORT = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
# Four running sequences, four waiting places: a request with n=4 fills the batch, the next ones queue.
QUEUE_CONFIG = EngineConfig(num_kv_blocks=128, max_num_seqs=4, max_queue_len=4)
# One running sequence; the waiting one fails after 0.5 s, every request after 2 s.
TIMED_CONFIG = EngineConfig(num_kv_blocks=128, max_num_seqs=1, max_queue_time=0.5, request_timeout=2.0)
# Far more tokens than the fastest CPU decodes in 2 s (SmolLM2 runs ~150 tokens/s here).
OVERTIME = {**LONG, "max_tokens": 1500}


@pytest.fixture(scope="module")
def queue_engine(smol_loaded: LoadedModel) -> Iterator[AsyncEngine]:
    with running_engine(QUEUE_CONFIG, smol_loaded) as engine:
        yield engine


@pytest.fixture(scope="module")
def url(queue_engine: AsyncEngine) -> Iterator[str]:
    with serving(queue_engine, ServerSettings([MODEL])) as url:
        yield url


@pytest.fixture(scope="module")
def timed_engine(smol_loaded: LoadedModel) -> Iterator[AsyncEngine]:
    with running_engine(TIMED_CONFIG, smol_loaded) as engine:
        yield engine


@pytest.fixture(scope="module")
def timed_url(timed_engine: AsyncEngine) -> Iterator[str]:
    with serving(timed_engine, ServerSettings([MODEL])) as url:
        yield url


@contextlib.contextmanager
def running_stream(url: str, body: dict) -> Iterator[Iterator[str]]:
    """A streaming completion that has produced its first token (so it holds its running slots); yields the
    data of its remaining events."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        data = stream_data(response)
        assert next(data).startswith("{")
        yield data


def stream_data(response: httpx.Response) -> Iterator[str]:
    return (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


def wait_until_idle(engine: AsyncEngine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.snapshot().num_unfinished or engine.snapshot().kv_cache_usage:
        assert time.monotonic() < deadline, f"still busy: {engine.snapshot()}"
        time.sleep(0.05)


def test_queue_places_count_every_sequence_of_n(url: str, queue_engine: AsyncEngine) -> None:
    def post(n: int, stream: bool = False) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", json={**SHORT, "n": n, "stream": stream}, timeout=60)

    three = {**SHORT, "n": 3, "stream": True}
    with running_stream(url, {**LONG, "n": 4}), httpx.stream("POST", f"{url}/v1/completions", json=three) as waiting:
        assert waiting.status_code == 200  # 3 of the 4 places
        full = post(n=2)
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert error_of(full)["code"] == "queue_full"
        assert "3 of 4 sequences" in error_of(full)["message"]
        never = post(n=5)  # more samples than max_num_seqs could never run: the client's mistake, not overload
        assert never.status_code == 400 and error_of(never)["param"] == "n"
    wait_until_idle(queue_engine)
    assert post(n=4).status_code == 200  # every place came back


def test_a_full_queue_sheds_before_parsing_and_is_counted_on_its_route(url: str, queue_engine: AsyncEngine) -> None:
    four = {**LONG, "n": 4, "stream": True}
    with running_stream(url, four), httpx.stream("POST", f"{url}/v1/completions", json=four) as waiting:
        assert waiting.status_code == 200  # the 4 waiting places are taken: nothing more fits
        shed = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=10)
        assert shed.status_code == 503 and shed.headers["retry-after"] == "1"
        assert error_of(shed)["code"] == "queue_full"  # not 400: refused before the body was read as JSON
        metrics = httpx.get(f"{url}/metrics").text
        shed_line = 'route="/v1/chat/completions",status="503"'
        assert any(shed_line in line for line in metrics.splitlines()), "the shed request lost its route label"
    wait_until_idle(queue_engine)
    assert httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=10).status_code == 400


def test_a_request_s_own_timeout_ends_its_wait_with_408(url: str, queue_engine: AsyncEngine) -> None:
    with running_stream(url, {**LONG, "n": 4}):
        started = time.monotonic()
        response = httpx.post(f"{url}/v1/completions", json={**SHORT, "timeout": 0.3}, timeout=60)
        assert response.status_code == 408, response.text
        assert (error_of(response)["code"], error_of(response)["param"]) == ("timeout", "timeout")
        assert time.monotonic() - started < 10
        chat = {"model": MODEL, "messages": HELLO, "max_tokens": 2, "timeout": 0.3, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat, timeout=60) as streamed:
            data = list(stream_data(streamed))
        assert "[DONE]" not in data and json.loads(data[-1])["error"]["code"] == "timeout"
    wait_until_idle(queue_engine)


def test_max_queue_time_is_503_and_request_timeout_504(timed_url: str, timed_engine: AsyncEngine) -> None:
    with running_stream(timed_url, OVERTIME) as running:
        queued = httpx.post(f"{timed_url}/v1/completions", json=SHORT, timeout=60)
        assert queued.status_code == 503 and queued.headers["retry-after"] == "1"
        assert error_of(queued)["code"] == "queue_timeout"
        data = list(running)  # the running stream hits the 2 s request timeout
    assert "[DONE]" not in data and json.loads(data[-1])["error"]["code"] == "request_timeout"
    alone = httpx.post(f"{timed_url}/v1/completions", json=OVERTIME, timeout=60)
    assert alone.status_code == 504 and error_of(alone)["code"] == "request_timeout"
    wait_until_idle(timed_engine)  # every limit released the blocks it held
    assert httpx.post(f"{timed_url}/v1/completions", json=SHORT, timeout=60).status_code == 200


def test_bodies_over_the_limit_get_413_declared_or_chunked(queue_engine: AsyncEngine) -> None:
    settings = ServerSettings([MODEL], max_request_bytes=2048)
    with serving(queue_engine, settings) as url:
        endpoint = f"{url}/v1/completions"
        big = {**SHORT, "prompt": "word " * 500}
        declared = httpx.post(endpoint, json=big)
        json_type = {"content-type": "application/json"}
        chunked = httpx.post(endpoint, content=iter([json.dumps(big).encode()]), headers=json_type)
        for response in (declared, chunked):
            assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"
            assert response.headers["x-request-id"]
        assert httpx.post(endpoint, json=SHORT, timeout=60).status_code == 200


def test_one_request_log_line_per_request(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pagedserve.requests")
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 3, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"X-Request-Id": "log-1"}) as r:
        list(stream_data(r))
    httpx.post(f"{url}/v1/chat/completions", json={**body, "temperature": 9}, headers={"X-Request-Id": "log-2"})
    httpx.get(f"{url}/health")  # probes write no line
    lines = {}
    for record in caplog.records:
        if record.name == "pagedserve.requests":
            line = json.loads(JsonFormatter().format(record))
            lines[line["request_id"]] = line
    assert set(lines) == {"log-1", "log-2"}
    done, refused = lines["log-1"], lines["log-2"]
    assert (done["status"], done["prompt_tokens"] > 0, done["output_tokens"]) == (200, True, 3)
    assert done["finish_reasons"] == ["length"] and 0 < done["ttft_s"] <= done["e2e_s"]
    assert (refused["status"], refused["error"], refused["ttft_s"]) == (400, "invalid_value", None)
    assert {"time", "level", "logger", "path", "method"} <= done.keys()


def test_uvicorn_s_access_log_in_json() -> None:
    args = ("127.0.0.1:5000", "GET", "/ready", "1.1", 200)
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d', args, None)
    line = json.loads(JsonFormatter().format(record))
    assert (line["client"], line["method"], line["path"], line["status"]) == ("127.0.0.1:5000", "GET", "/ready", 200)


def test_limit_flags() -> None:
    args = cli.build_parser().parse_args(
        ["serve", "--max-queue-time", "2", "--request-timeout", "60", "--max-request-bytes", "100",
         "--shutdown-timeout", "5", "--log-format", "json"]
    )  # fmt: skip
    assert (args.max_queue_time, args.request_timeout, args.max_request_bytes) == (2.0, 60.0, 100)
    assert (args.shutdown_timeout, args.log_format) == (5.0, "json")
    for bad in (["--shutdown-timeout", "0"], ["--max-request-bytes", "-1"], ["--shutdown-timeout", "nan"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", *bad])
