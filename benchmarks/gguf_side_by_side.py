"""pagedserve and llama-server side by side on one GGUF file: start-up, memory and decode speed.

    python -m benchmarks.gguf_models --shape 1b --mix q4_0 --out /tmp/llama-1b-q4_0.gguf
    python -m benchmarks.gguf_side_by_side /tmp/llama-1b-q4_0.gguf --llama-server /tmp/llama-server

Each server runs alone with the same threads (2 by default), in turn, on the same file:
- ready: seconds from start until the server answers its readiness probe; pagedserve twice, first with an
  empty cache folder (PAGEDSERVE_CACHE_DIR: the file's config, tokenizer and tensor index are read once), then
  with it filled;
- memory: the process tree's peak resident memory while loading, and once ready (after the first request);
- one stream: short chat prompts one after another, 128 output tokens each, greedy, EOS ignored, streamed;
  tokens/s over the requests' whole time, and over their decoding alone (first token to last, so without the
  prompts' prefill): the weight bytes decoding reads each second (every projection and the head once a token);
- N streams: N such requests at once, output tokens/s over the batch.
The machine's copy bandwidth (a 1 GiB torch copy with the same threads, read + write bytes) is measured just
before and just after each server's one stream, and that stream's weight read rate is compared with the mean of
the two: on a shared machine the copy's rate moves by a third within minutes. A read-only pass over the same
GiB (a sum), measured alongside, shows how close to the memory's read rate decoding comes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from benchmarks.compare import USER_ENV, ManagedServer, free_port, process_tree, resident_kib
from pagedserve.engine.worker.weights.gguf_index import read_index

HOST = "127.0.0.1"
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for a job interview.",
)


def server_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    pinned = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    return {**USER_ENV, **pinned, **(extra or {})}


def pagedserve_server(model: Path, threads: int, cache: Path, streams: int, log: Path) -> ManagedServer:
    port = free_port()
    pagedserve = str(Path(sys.executable).parent / "pagedserve")
    argv = [pagedserve, "serve", str(model), "--port", str(port), "--log-level", "warning",
            "--max-num-seqs", str(max(streams, 8)), "--max-model-len", "4096"]  # fmt: skip
    env = server_env(threads, {"PAGEDSERVE_CACHE_DIR": str(cache)})
    return ManagedServer("pagedserve", argv, f"http://{HOST}:{port}/ready", log, env)


def llama_server(binary: str, model: Path, threads: int, streams: int, log: Path) -> ManagedServer:
    port = free_port()
    argv = [binary, "-m", str(model), "--host", HOST, "--port", str(port), "-np", str(streams),
            "-c", str(streams * 1024), "-t", str(threads), "-tb", str(threads), "--no-webui"]  # fmt: skip
    return ManagedServer("llama.cpp", argv, f"http://{HOST}:{port}/health", log, server_env(threads))


class PeakMemory:
    """Samples a process tree's resident memory every 50 ms while it loads."""

    def __init__(self, server: ManagedServer) -> None:
        self.server, self.peak_mib, self._stop = server, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            process = self.server.process
            if process is not None and process.poll() is None:
                rss = sum(resident_kib(pid) for pid in process_tree(process.pid)) / 1024
                self.peak_mib = max(self.peak_mib, rss)
            time.sleep(0.05)


@contextlib.contextmanager
def started(server: ManagedServer) -> Iterator[tuple[ManagedServer, float, float]]:
    """(the server, seconds until ready, peak MiB while loading)."""
    with server:  # stopped on the way out
        with PeakMemory(server) as memory:
            ready_s = server.wait_ready()
        yield server, ready_s, memory.peak_mib


async def chat(client: httpx.AsyncClient, base: str, prompt: str, tokens: int) -> tuple[int, float]:
    """Streams one chat completion: (completion tokens, seconds from its first token to its last)."""
    body = {
        "model": client.headers["x-model"],
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = last = 0.0
    completion_tokens = 0
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("choices"):  # the first with text marks the first token (a role-only chunk may come before)
                last = time.perf_counter()
                first = first or (last if chunk["choices"][0].get("delta", {}).get("content") else 0.0)
            if chunk.get("usage"):
                completion_tokens = int(chunk["usage"]["completion_tokens"])
    return completion_tokens, last - first


async def tokens_per_second(base: str, streams: int, tokens: int, rounds: int) -> tuple[float, float]:
    """Output tokens/s over the whole run, and a stream's decoding rate (tokens after each request's first, over
    its first-to-last seconds): `streams` requests at once, `rounds` times (one stream: one after another)."""
    # A connection per request: llama-server may close one after a stream, and a pooled one it closed fails the next.
    async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as client:
        models = (await client.get(f"{base}/v1/models")).json()["data"]
        client.headers["x-model"] = models[0]["id"]  # the name each server answers to
        await chat(client, base, PROMPTS[0], 8)  # warm-up
        start, produced, decoded, decoding_s = time.perf_counter(), 0, 0, 0.0
        for round_ in range(rounds):
            batch = [chat(client, base, PROMPTS[(round_ + i) % len(PROMPTS)], tokens) for i in range(streams)]
            for completion_tokens, seconds in await asyncio.gather(*batch):
                produced += completion_tokens
                decoded += completion_tokens - 1
                decoding_s += seconds
        return produced / (time.perf_counter() - start), decoded / decoding_s


def bandwidth_gbs(threads: int) -> tuple[float, float]:
    """GB/s with `threads` threads, best of 5: a 1 GiB float32 copy (read + write bytes, STREAM's Copy), and a
    sum of the same GiB (bytes read)."""
    import torch

    torch.set_num_threads(threads)
    source = torch.ones(2**28)
    target = torch.empty_like(source)
    nbytes = source.numel() * 4
    copy = read = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        middle = time.perf_counter()
        source.sum()
        copy, read = min(copy, middle - start), min(read, time.perf_counter() - middle)
    return 2 * nbytes / copy / 1e9, nbytes / read / 1e9


def weight_bytes_per_token(model: Path) -> int:
    """Bytes a decode step reads: every projection, and the head (output, or a tied token_embd)."""
    tensors = read_index(model).tensors
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return sum(t.nbytes for name, t in tensors.items() if name.startswith("blk.") or name == head)


def measure(server: ManagedServer, args: argparse.Namespace) -> dict[str, float]:
    base = server.ready_url.rsplit("/", 1)[0]
    before = bandwidth_gbs(args.threads)
    one, one_decoding = asyncio.run(tokens_per_second(base, 1, args.output_tokens, len(PROMPTS)))
    after = bandwidth_gbs(args.threads)
    rss = server.resident_mib()
    many, _ = asyncio.run(tokens_per_second(base, args.streams, args.output_tokens, 1))
    copy, read = ((b + a) / 2 for b, a in zip(before, after, strict=True))
    return {"one": one, "decoding": one_decoding, "many": many, "rss": rss, "copy": copy, "read": read}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--llama-server", default="/tmp/llama-server")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--skip-llama", action="store_true")
    args = parser.parse_args()
    size_mib = args.model.stat().st_size / 2**20
    per_token = weight_bytes_per_token(args.model)
    logs = Path(tempfile.mkdtemp(prefix="side-by-side-"))
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as cache:
        with started(pagedserve_server(args.model, args.threads, Path(cache), args.streams, logs / "cold.log")) as (
            _,
            cold_s,
            _peak,
        ):
            pass
        with started(pagedserve_server(args.model, args.threads, Path(cache), args.streams, logs / "p.log")) as (
            server,
            ready_s,
            peak,
        ):
            rows["pagedserve"] = {"cold": cold_s, "ready": ready_s, "peak": peak, **measure(server, args)}
    if not args.skip_llama:
        with started(llama_server(args.llama_server, args.model, args.threads, args.streams, logs / "l.log")) as (
            server,
            ready_s,
            peak,
        ):
            rows["llama.cpp"] = {"cold": ready_s, "ready": ready_s, "peak": peak, **measure(server, args)}
    report(args, size_mib, per_token, rows)
    print(f"(server logs in {logs})")


def report(args: argparse.Namespace, size_mib: float, per_token: int, rows: dict[str, dict[str, float]]) -> None:
    print(f"{args.model.name}: {size_mib:.0f} MiB, {per_token / 2**20:.0f} MiB of weights read per token; "
          f"{args.threads} threads")  # fmt: skip
    print("| server | ready, cold (s) | ready (s) | peak loading (MiB) | resident (MiB) | 1 stream tok/s | "
          "decoding tok/s | decoding's weights read (GB/s) | copy around it (GB/s, read + write) | % of copy | "
          f"read-only pass (GB/s) | % of it | {args.streams} streams tok/s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        read = row["decoding"] * per_token / 1e9
        print(f"| {name} | {row['cold']:.1f} | {row['ready']:.1f} | {row['peak']:.0f} | {row['rss']:.0f} | "
              f"{row['one']:.1f} | {row['decoding']:.1f} | {read:.1f} | {row['copy']:.1f} | "
              f"{100 * read / row['copy']:.0f}% | {row['read']:.1f} | {100 * read / row['read']:.0f}% | "
              f"{row['many']:.1f} |")  # fmt: skip
    if len(rows) == 2:
        ours, theirs = rows["pagedserve"], rows["llama.cpp"]
        print(f"pagedserve / llama.cpp: 1 stream {ours['one'] / theirs['one']:.2f}x, "
              f"{args.streams} streams {ours['many'] / theirs['many']:.2f}x; peak loading "
              f"{ours['peak'] / size_mib:.2f}x the file")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
