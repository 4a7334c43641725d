"""Many streams at once, clients that hang up, and what /metrics says afterwards."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.hostile_inputs import head_only
from pagedserve.engine import EngineConfig
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.server import ServerSettings
from tests.servers import engine_and_url

MODEL = "smol"
NUM_STREAMS = 32
MAX_TOKENS = 8


engine, url = engine_and_url(EngineConfig(num_kv_blocks=256, max_num_seqs=32), ServerSettings([MODEL]))


def body(i: int, max_tokens: int, stream: bool = True) -> dict:
    """A short prompt (cheap prefill on CPU), generating exactly max_tokens."""
    return {"model": MODEL, "prompt": f"{i}, {i + 1},", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name and labels, e.g. 'pagedserve:request_success_total{abort}'."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            labels = ",".join(v for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def wait_until_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        current = metrics(url)
        if current["pagedserve:num_requests_running"] == current["pagedserve:num_requests_waiting"] == 0:
            return current
        assert time.monotonic() < deadline, "requests still running after their clients left"
        time.sleep(0.05)


def assert_all_blocks_free(engine: AsyncEngine, url: str) -> None:
    """Read while idle: every block is free, or cached with no reference, and no queue place is held; /metrics
    says so too (what the soak reads from a server in another process)."""
    snapshot = engine.snapshot()
    assert snapshot.num_free_blocks == engine.info.num_kv_blocks
    assert snapshot.kv_cache_usage == 0.0
    gauges = metrics(url)
    assert gauges["pagedserve:num_free_kv_blocks"] == gauges["pagedserve:num_kv_blocks"] == engine.info.num_kv_blocks
    assert gauges["pagedserve:num_queue_places_held"] == 0


async def read_stream(client: httpx.AsyncClient, i: int, hang_up_after: int | None) -> list[str]:
    """The stream's data payloads; with hang_up_after, closes the connection after that many."""
    data = []
    async with client.stream("POST", "/v1/completions", json=body(i, max_tokens=MAX_TOKENS)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data.append(line.removeprefix("data: "))
                if len(data) == hang_up_after:
                    break  # leaving the block mid-body closes the connection
    return data


def test_concurrent_streams_with_a_third_hanging_up(url: str, engine: AsyncEngine) -> None:
    before = metrics(url)
    hang_ups = {i for i in range(NUM_STREAMS) if i % 3 == 0}

    async def run() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            streams = [read_stream(client, i, 3 if i in hang_ups else None) for i in range(NUM_STREAMS)]
            return await asyncio.gather(*streams)

    results = asyncio.run(run())
    for i, data in enumerate(results):
        assert (data[-1] == "[DONE]") != (i in hang_ups)
    after = wait_until_idle(url)
    assert after["pagedserve:kv_cache_usage_perc"] == 0.0
    assert_all_blocks_free(engine, url)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert grew("pagedserve:request_success_total{abort}") == len(hang_ups)
    assert grew("pagedserve:request_success_total{length}") == NUM_STREAMS - len(hang_ups)
    assert grew("pagedserve:generation_tokens_total") >= MAX_TOKENS * (NUM_STREAMS - len(hang_ups))
    assert grew("pagedserve:time_to_first_token_seconds_count") == NUM_STREAMS
    assert grew("pagedserve:http_requests_total{POST,/v1/completions,200}") == NUM_STREAMS
    assert after["pagedserve:prefix_cache_queries_total"] > 0
    assert after["pagedserve:iteration_tokens_total_count"] > 0
    assert after["pagedserve:inter_token_latency_seconds_count"] > 0


def test_closing_the_socket_mid_stream_aborts_the_request(url: str, engine: AsyncEngine) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=body(0, max_tokens=400), timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        next(lines), next(lines)  # two tokens in, the client goes away
    started = time.monotonic()
    after = wait_until_idle(url)
    assert time.monotonic() - started < 10, "the request ran on instead of being aborted"
    assert after["pagedserve:kv_cache_usage_perc"] == 0.0
    assert_all_blocks_free(engine, url)


def test_hanging_up_on_a_non_streaming_request_aborts_it(url: str, engine: AsyncEngine) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body(1, max_tokens=400, stream=False), timeout=1.0)
    wait_until_idle(url, timeout=10)
    assert_all_blocks_free(engine, url)


def test_metrics_count_the_queue_place_a_request_holds_while_its_body_is_awaited(url: str) -> None:
    """The door reserves a place once the headers are in; the place comes back when the client leaves."""
    host, port = url.removeprefix("http://").split(":")

    def held() -> float:
        return metrics(url)["pagedserve:num_queue_places_held"]

    def wait_for(value: float) -> None:
        deadline = time.monotonic() + 10
        while held() != value:
            assert time.monotonic() < deadline, f"{held()} places held, expected {value}"
            time.sleep(0.05)

    assert held() == 0
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head_only("/v1/completions", content_length=100))
        wait_for(1)
    wait_for(0)
