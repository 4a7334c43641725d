"""Overload: past --max-queue-len the server sheds load with an immediate 503, and what it admitted finishes."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from pagedserve.engine import EngineConfig
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings
from tests.servers import served_engine

MODEL = "smol"
NUM_REQUESTS = 40
# Two sequences run, four may wait: a burst of 40 overflows at once.
CONFIG = EngineConfig(num_kv_blocks=64, max_num_seqs=2, max_queue_len=4)
BODY = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
SHED_P99_LIMIT = 0.050  # seconds, server-side: the 503 path must not wait on the engine


@pytest.fixture(scope="module")
def url(smol_loaded: LoadedModel) -> Iterator[str]:
    with served_engine(CONFIG, smol_loaded, ServerSettings([MODEL])) as url:
        yield url


@dataclass
class Answer:
    status: int
    body: dict
    retry_after: str | None
    seconds: float  # client-side


async def burst(url: str) -> list[Answer]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one() -> Answer:
            start = time.perf_counter()
            response = await client.post("/v1/completions", json=BODY)
            seconds = time.perf_counter() - start
            return Answer(response.status_code, response.json(), response.headers.get("retry-after"), seconds)

        return await asyncio.gather(*(one() for _ in range(NUM_REQUESTS)))


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def test_a_burst_past_the_queue_is_shed_at_once_and_the_admitted_finish(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    expected = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    caplog.set_level(logging.INFO, logger="pagedserve.requests")
    answers = asyncio.run(burst(url))

    admitted = [a for a in answers if a.status == 200]
    shed = [a for a in answers if a.status == 503]
    assert len(admitted) + len(shed) == NUM_REQUESTS, sorted({a.status for a in answers})
    # At least what an idle engine holds: every free seat and the whole queue.
    min_admitted = CONFIG.max_num_seqs + CONFIG.max_queue_len
    assert len(admitted) >= min_admitted and len(shed) >= NUM_REQUESTS // 2, (len(admitted), len(shed))
    for answer in shed:
        assert answer.retry_after == "1" and answer.body["error"]["code"] == "queue_full"
    for answer in admitted:  # greedy: the batch it ran in changes nothing
        (choice,) = answer.body["choices"]
        assert (choice["text"], choice["finish_reason"]) == (expected, "length")
        assert answer.body["usage"]["completion_tokens"] == BODY["max_tokens"]

    lines = [getattr(record, "fields", {}) for record in caplog.records]
    server_side = [line["e2e_s"] for line in lines if line.get("status") == 503]
    assert len(server_side) == len(shed)
    client_side = [a.seconds for a in shed]
    figures = (
        f"503s: {len(shed)}, server-side p50 {statistics.median(server_side) * 1000:.1f} ms "
        f"p99 {p99(server_side) * 1000:.1f} ms; client-side p50 {statistics.median(client_side) * 1000:.1f} ms "
        f"p99 {p99(client_side) * 1000:.1f} ms"
    )
    print(figures)
    assert p99(server_side) < SHED_P99_LIMIT, figures
