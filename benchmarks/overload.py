"""Overload: how long a client waits for its 503 while the engine is saturated.

Starts a server on 127.0.0.1 in this process, fills the running batch and the waiting queue with long
streaming requests, then sends chat requests one at a time and times each 503: client-side (sent -> answer
read) and server-side (the request log's e2e: body received -> answer sent). The target is p99 < 50 ms.

    python -m benchmarks.overload [--probes 200] [--max-num-seqs 4] [--max-queue-len 8] [any engine flag]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time

import httpx

from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.server import ServerSettings, create_app
from pagedserve.server.engine_args import add_engine_args, engine_config
from pagedserve.server.request_log import request_logger
from tests.background import BackgroundServer

MODEL = "overload"
TARGET_P99_MS = 50.0
LONG = {"model": MODEL, "prompt": "Once upon a time", "ignore_eos": True, "stream": True}  # + the whole context
PROBE = {"model": MODEL, "messages": [{"role": "user", "content": "Are you busy?"}], "max_tokens": 1}


class ShedTimes(logging.Handler):
    """The server-side e2e of every 503 in the request log."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", {})
        if fields.get("status") == 503:
            self.seconds.append(fields["e2e_s"])


async def hold(client: httpx.AsyncClient, max_tokens: int, started: asyncio.Event) -> None:
    """One long stream that keeps its place (running or waiting) until cancelled; retries while shed."""
    while True:
        async with client.stream("POST", "/v1/completions", json={**LONG, "max_tokens": max_tokens}) as response:
            if response.status_code == 200:
                started.set()
                async for _ in response.aiter_lines():
                    pass
                return
            if response.status_code != 503:
                raise RuntimeError(f"a holding request got {response.status_code}: {(await response.aread())!r}")
        await asyncio.sleep(0.1)


async def measure(url: str, num_holders: int, max_tokens: int, probes: int) -> tuple[list[float], int]:
    """Client-side seconds of each 503, and how many probes got something else."""
    limits = httpx.Limits(max_connections=num_holders + 1)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        events = [asyncio.Event() for _ in range(num_holders)]
        holders = [asyncio.create_task(hold(client, max_tokens, event)) for event in events]
        await asyncio.gather(*(event.wait() for event in events))
        await asyncio.sleep(1.0)  # let the engine admit its batch; the rest wait in the queue
        seconds, others = [], 0
        for _ in range(probes):
            start = time.perf_counter()
            response = await client.post("/v1/chat/completions", json=PROBE)
            if response.status_code == 503:
                seconds.append(time.perf_counter() - start)
            else:
                others += 1
        for holder in holders:
            holder.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    return seconds, others


def percentiles_ms(seconds: list[float]) -> str:
    ms = sorted(1000 * s for s in seconds)
    p50, p90, p99 = (statistics.quantiles(ms, n=100, method="inclusive")[q - 1] for q in (50, 90, 99))
    return f"p50 {p50:.1f} ms, p90 {p90:.1f} ms, p99 {p99:.1f} ms, max {ms[-1]:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probes", type=int, default=200)
    add_engine_args(parser)
    parser.set_defaults(max_num_seqs=4, max_queue_len=8)
    args = parser.parse_args()
    config = engine_config(args)
    engine = AsyncEngine.from_config(config).start()
    if not engine.wait_ready():
        sys.exit(f"the engine failed to load: {engine.unavailable_reason()}")
    shed = ShedTimes()
    request_logger.addHandler(shed)
    request_logger.setLevel(logging.INFO)
    try:
        with BackgroundServer(create_app(engine, ServerSettings([MODEL]))) as server:
            num_holders = config.max_num_seqs + config.max_queue_len
            max_tokens = engine.limits.max_model_len
            client_side, others = asyncio.run(measure(server.url, num_holders, max_tokens, args.probes))
    finally:
        engine.shutdown()
    if not client_side:
        sys.exit(f"no probe got a 503 ({others} got something else): the engine was not saturated")
    print(f"saturated: {config.max_num_seqs} running + {config.max_queue_len} waiting; {args.probes} probes")
    print(f"503s: {len(client_side)}, other answers: {others}")
    print(f"time to 503, client-side: {percentiles_ms(client_side)}")
    print(f"time to 503, server-side: {percentiles_ms(shed.seconds)}")
    p99 = statistics.quantiles(client_side, n=100, method="inclusive")[98] * 1000
    print(f"target p99 < {TARGET_P99_MS:.0f} ms (client-side): {'ok' if p99 < TARGET_P99_MS else 'MISSED'}")


if __name__ == "__main__":
    main()
