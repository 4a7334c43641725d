"""Isolation: does a busy server still answer at once? Two figures, against a real `pagedserve serve` process.

1. Overload: bursts of 40 simultaneous streaming chat requests at a server with 4 seats and a queue of 4;
   the 32 it cannot take must get 503 + Retry-After fast (target: client-side p99 < 50 ms).
2. Big bodies: 4 client processes keep posting ~900 KB bodies to /tokenize and /v1/chat/completions while
   a prober GETs /health every 50 ms (target: p99 < 100 ms) and one stream runs (its longest stall).

    python -m benchmarks.isolation [--rounds 5] [--seconds 20] [--server-pythonpath DIR] [-- serve flags]

--server-pythonpath runs another checkout's server (a folder holding a `pagedserve` link to it), for A/Bs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.servers import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
MODEL = "isolation"
BIG_TEXT = "The quick brown fox jumps over the lazy dog. " * 20_000  # ~900 KB
STREAM = {"model": MODEL, "stream": True, "max_tokens": 64, "ignore_eos": True}
TARGET_503_P99_MS = 50.0
TARGET_HEALTH_P99_MS = 100.0


def start_server(flags: list[str], pythonpath: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pagedserve.server.cli", "serve", "--port", str(port), "--served-model-name"]
    command += [MODEL, "--log-level", "warning", *flags]
    server = subprocess.Popen(command, env=env, cwd="/", stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    if not wait_ready(server, url, timeout=300):
        server.kill()
        sys.exit("the server did not become ready")
    return server, url


# ---- 1. overload ------------------------------------------------------------------------------------------


class Connection:
    """A bare HTTP/1.1 keep-alive connection: the client's own cost stays out of the figure (httpx spends
    milliseconds per request in Python, which 40 simultaneous requests from one event loop would add up)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> Connection:
        host, port = url.removeprefix("http://").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    def send(self, path: str, body: dict) -> None:
        payload = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        self.writer.write(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)

    async def read_head(self) -> tuple[int, dict[str, str]]:
        status = int((await self.reader.readline()).split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    def close(self) -> None:
        self.writer.close()


async def burst(url: str, size: int) -> tuple[list[float], int]:
    """Seconds from sending to each 503 + Retry-After, of `size` simultaneous streams on open connections;
    and how many were taken. Hanging up then aborts the taken ones: the next burst finds an idle server."""
    connections = await asyncio.gather(*(Connection.open(url) for _ in range(size)))
    shed: list[float] = []
    taken = 0

    async def one(i: int, connection: Connection) -> None:
        nonlocal taken
        body = {**STREAM, "messages": [{"role": "user", "content": f"Tell me a story, number {i}."}]}
        start = time.perf_counter()
        connection.send("/v1/chat/completions", body)
        status, headers = await connection.read_head()
        if status == 503 and "retry-after" in headers:
            shed.append(time.perf_counter() - start)
        else:
            taken += 1

    await asyncio.gather(*(one(i, c) for i, c in enumerate(connections)))
    for connection in connections:
        connection.close()
    return shed, taken


async def burst_without_gc(url: str, size: int) -> tuple[list[float], int]:
    """burst() with this client's garbage collector paused: a collection of the client's heap mid-burst (tens of
    milliseconds on this machine) would be counted as the server's latency."""
    gc.collect()
    gc.disable()
    try:
        return await burst(url, size)
    finally:
        gc.enable()


async def overload(url: str, rounds: int, size: int) -> list[float]:
    await burst(url, 4)  # warm-up
    shed: list[float] = []
    for _ in range(rounds):
        await asyncio.sleep(1.0)
        seconds, taken = await burst_without_gc(url, size)
        shed += seconds
        slowest = 1000 * max(seconds, default=0.0)
        print(f"  burst of {size}: {len(seconds)} shed with 503 + Retry-After, slowest {slowest:.1f} ms; {taken} taken")
    return shed


# ---- 2. big bodies ---------------------------------------------------------------------------------------


def post_big_bodies(url: str, seconds: float, worker: int) -> int:
    """One client process: alternately tokenizes and chats with ~900 KB bodies; returns how many it sent."""
    bodies = [
        ("/tokenize", {"model": MODEL, "prompt": BIG_TEXT}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": BIG_TEXT}]}),
    ]
    sent = 0
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            path, body = bodies[(sent + worker) % 2]
            client.post(path, json=body)
            sent += 1
    return sent


async def probe_health(url: str, seconds: float) -> tuple[list[float], float]:
    """/health latencies every 50 ms, and the longest gap between chunks of one stream meanwhile."""
    latencies: list[float] = []
    gaps: list[float] = []

    async def stream(client: httpx.AsyncClient) -> None:
        body = {**STREAM, "max_tokens": 4000, "messages": [{"role": "user", "content": "Count to a million."}]}
        deadline = time.monotonic() + seconds
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"the stream got {response.status_code}: {(await response.aread())!r}")
            last = time.perf_counter()
            async for _ in response.aiter_lines():
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                if time.monotonic() > deadline:
                    return

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        streamer = asyncio.create_task(stream(client))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            start = time.perf_counter()
            await client.get("/health")
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)
        await streamer
    return latencies, max(gaps[1:], default=0.0)


def wait_idle(url: str, timeout: float = 60.0) -> None:
    """Until /metrics shows no request running or waiting."""
    busy = re.compile(r"^pagedserve:num_requests_(?:running|waiting)\{[^}]*\} (?!0\.0$)", re.MULTILINE)
    deadline = time.monotonic() + timeout
    while busy.search(httpx.get(f"{url}/metrics").text) and time.monotonic() < deadline:
        time.sleep(0.1)


def big_bodies(url: str, seconds: float, clients: int) -> tuple[list[float], float, int]:
    with multiprocessing.get_context("spawn").Pool(clients) as pool:
        posted = pool.starmap_async(post_big_bodies, [(url, seconds, i) for i in range(clients)])
        time.sleep(1.0)  # the clients are posting
        latencies, stall = asyncio.run(probe_health(url, seconds - 2))
        return latencies, stall, sum(posted.get())


# ---- report ----------------------------------------------------------------------------------------------


def summary_ms(seconds: list[float]) -> tuple[str, float]:
    ms = sorted(1000 * s for s in seconds)
    p50, p99 = (statistics.quantiles(ms, n=100, method="inclusive")[q - 1] for q in (50, 99))
    return f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {ms[-1]:.1f} ms (n={len(ms)})", p99


def verdict(p99: float, target: float) -> str:
    return f"target p99 < {target:.0f} ms: {'ok' if p99 < target else 'MISSED'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--burst", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--server-pythonpath")
    parser.add_argument("serve_flags", nargs="*", help="extra `pagedserve serve` flags (after --)")
    args = parser.parse_args()
    flags = ["--max-num-seqs", "4", "--max-queue-len", "4", "--num-kv-blocks", "1024", *args.serve_flags]
    server, url = start_server(flags, args.server_pythonpath)
    try:
        print(f"server: pagedserve serve {' '.join(flags)}; {os.cpu_count()} CPUs")
        shed = asyncio.run(overload(url, args.rounds, args.burst))
        text, p99 = summary_ms(shed)
        print(f"time to 503 + Retry-After, client-side: {text}; {verdict(p99, TARGET_503_P99_MS)}")
        wait_idle(url)  # the last burst's hung-up streams are aborted at the core's next iteration
        latencies, stall, posted = big_bodies(url, args.seconds, args.clients)
        text, p99 = summary_ms(latencies)
        print(f"{args.clients} clients posted {posted} bodies of ~{len(BIG_TEXT) // 1000} KB in {args.seconds:g} s")
        print(f"GET /health meanwhile: {text}; {verdict(p99, TARGET_HEALTH_P99_MS)}")
        print(f"longest stall of a running stream meanwhile: {1000 * stall:.0f} ms")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
