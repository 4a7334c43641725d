"""llama-server as a contender in benchmarks/speculative.py: the same GGUF, the same chat prompts, one stream.

It runs without speculation of its own (no draft model, no lookup decoding), with the threads pagedserve has,
greedy, with a slot for each of a workload's prompts: after the warm-up each prompt finds its tokens cached in its
slot (llama-server picks the slot whose cached prompt shares the most), as pagedserve finds them in its prefix
cache. A request's tok/s counts its completion tokens over the request's whole time, as pagedserve's do.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from benchmarks.compare import ManagedServer, free_port
from benchmarks.gguf_side_by_side import HOST, server_env

SLOTS = 3  # one a prompt of a workload
SLOT_CONTEXT = 4096  # a grounded prompt (~600 tokens with its template) and 256 output tokens fit with room to spare


def llama_server_argv(binary: str, model: Path, threads: int, port: int) -> list[str]:
    return [binary, "-m", str(model), "--host", HOST, "--port", str(port), "-np", str(SLOTS),
            "-c", str(SLOTS * SLOT_CONTEXT), "-t", str(threads), "-tb", str(threads), "--no-webui"]  # fmt: skip


class LlamaServer:
    """A started llama-server and a client for its chat endpoint."""

    def __init__(self, server: ManagedServer, base: str) -> None:
        self.server, self.base = server, base
        self.client = httpx.Client(timeout=600)
        self.model = self.client.get(f"{base}/v1/models").json()["data"][0]["id"]

    def chat(self, prompt: str, max_tokens: int) -> tuple[int, float]:
        """(completion tokens, seconds) of one greedy chat request."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        start = time.perf_counter()
        response = self.client.post(f"{self.base}/v1/chat/completions", json=body)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"]), time.perf_counter() - start


@contextlib.contextmanager
def started_llama_server(binary: str, model: Path, threads: int, log: Path) -> Iterator[LlamaServer]:
    port = free_port()
    argv = llama_server_argv(binary, model, threads, port)
    with ManagedServer("llama.cpp", argv, f"http://{HOST}:{port}/health", log, server_env(threads)) as server:
        server.wait_ready()
        peer = LlamaServer(server, f"http://{HOST}:{port}")
        try:
            yield peer
        finally:
            peer.client.close()


def describe_flags(binary: str, model: Path, threads: int) -> str:
    """The command line the run used (the port aside), for the report."""
    return " ".join(llama_server_argv(binary, model, threads, 0)).replace("--port 0 ", "")
