"""What a long scoring request costs, through the server (the cost half of `python -m benchmarks.scoring`).

One prompt of ~3,000 tokens of English (this checkout's README and docs), `max_tokens: 1`, sent one request at a
time, each beside a streaming request that keeps decoding: without logprobs (a fresh prompt, then the same one
again, served from the prefix cache), with `prompt_logprobs: 20`, and with `echo` + `logprobs: 20`. Each fresh
prompt starts with its own words, so no request reuses another's cached blocks. Scoring requests never use the
prefix cache (a cached block has no hidden states to score): their fair comparison is the fresh prefill.

Figures: each request's seconds, and the engine core's CPU seconds meanwhile (steadier than the clock on a
shared machine; the stream's decoding is in both), and the stream's longest wait between two chunks while it
ran, against the stream's wait alone (one decode step). A prefill chunk of a full token budget is one step
too: the fresh unscored prompt's longest wait is what one full step costs.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["README.md", "docs/architecture.md", "docs/responses-api.md", "benchmarks/README.md"]
WARM_CHUNKS = 8  # chunks the stream sends alone before the measured request: its normal wait
TARGET_RATIO = 2.0


@dataclass
class Cost:
    name: str
    seconds: float
    core_cpu_seconds: float
    longest_wait: float  # the stream's, while the request ran
    normal_wait: float  # the stream's median wait alone


class Stream:
    """A streaming completion on a thread, and when each of its chunks arrived."""

    def __init__(self, url: str, model: str) -> None:
        self.times: list[float] = []
        self._body = {"model": model, "prompt": "Once upon a time", "stream": True, "max_tokens": 4000}
        self._body |= {"ignore_eos": True, "temperature": 0}
        self._url = url
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Stream:
        self._thread.start()
        deadline = time.monotonic() + 300
        while len(self.times) < WARM_CHUNKS:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the stream did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=300)

    def _run(self) -> None:
        with (
            httpx.Client(base_url=self._url, timeout=None) as client,
            client.stream("POST", "/v1/completions", json=self._body) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.times.append(time.perf_counter())
                if self._stop.is_set():
                    return

    def normal_wait(self) -> float:
        return statistics.median(b - a for a, b in itertools.pairwise(self.times[1 : WARM_CHUNKS + 1]))

    def longest_wait(self, start: float, end: float) -> float:
        """The longest wait between chunks that overlaps [start, end] (a wait still open at `end` counts to it)."""
        times = [*self.times, end]
        return max((b - a for a, b in itertools.pairwise(times) if b > start and a < end), default=0.0)


def long_prompts(tokenizer: Any, num_tokens: int, count: int) -> list[list[int]]:
    """`count` prompts of `num_tokens` tokens, each opening with its own words (no shared cached block)."""
    text = "\n\n".join((ROOT / name).read_text() for name in TEXTS)
    body = tokenizer.encode(text, add_special_tokens=False)
    while len(body) < num_tokens:
        body += body
    prompts = []
    for index in range(count):
        opening = tokenizer.encode(f"Document {index}, a copy for reader number {index * 7919}:\n")
        prompts.append(opening + body[: num_tokens - len(opening)])
    return prompts


def core_cpu_seconds() -> float:
    """CPU seconds so far of this process's engine core (its child process), user and system, every thread."""
    cores = [p for p in psutil.Process().children() if "pagedserve.engine.core" in " ".join(p.cmdline())]
    return sum(t.user + t.system for t in (p.cpu_times() for p in cores))


def scoring_cost(url: str, model: str, tokenizer: Any, num_tokens: int, rounds: int) -> list[Cost]:
    """Each case's best of `rounds` (fresh prompts each round): the least disturbed by a shared machine."""
    fresh = long_prompts(tokenizer, num_tokens, 3 * rounds + 1)
    measured: dict[str, list[Cost]] = {}
    with httpx.Client(base_url=url, timeout=None) as client:
        client.post("/v1/completions", json={"model": model, "prompt": fresh[-1][:64], "max_tokens": 1})  # warm-up
        for round_ in range(rounds):
            plain, scored, echoed = fresh[3 * round_ : 3 * round_ + 3]
            for name, prompt, extra in [
                ("no logprobs", plain, {}),
                ("no logprobs, prefix cached (the same prompt again)", plain, {}),
                ("prompt_logprobs 20", scored, {"prompt_logprobs": 20}),
                ("echo + logprobs 20", echoed, {"echo": True, "logprobs": 20}),
            ]:
                measured.setdefault(name, []).append(_measure(client, url, model, name, prompt, extra))
    return [
        Cost(
            name,
            *(min(getattr(c, field) for c in runs) for field in ("seconds", "core_cpu_seconds", "longest_wait")),
            statistics.median(c.normal_wait for c in runs),
        )
        for name, runs in measured.items()
    ]


def _measure(client: httpx.Client, url: str, model: str, name: str, prompt: list[int], extra: dict) -> Cost:
    with Stream(url, model) as stream:
        cpu = core_cpu_seconds()
        start = time.perf_counter()
        reply = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, **extra})
        end = time.perf_counter()
        cpu = core_cpu_seconds() - cpu
    reply.raise_for_status()
    return Cost(name, end - start, cpu, stream.longest_wait(start, end), stream.normal_wait())


def print_cost(costs: list[Cost], num_tokens: int) -> None:
    plain = costs[0]
    print(
        f"\nA {num_tokens}-token prompt, max_tokens 1, one at a time, each beside a streaming request (best of rounds):"
    )
    print("| request | seconds | / fresh unscored | core CPU seconds | / fresh unscored | stream's longest wait (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for cost in costs:
        cpu = cost.core_cpu_seconds
        print(
            f"| {cost.name} | {cost.seconds:.2f} | {cost.seconds / plain.seconds:.2f}x | {cpu:.1f} | "
            f"{cpu / plain.core_cpu_seconds:.2f}x | {cost.longest_wait:.2f} |"
        )
    print(f"the stream's wait alone (one decode step): median {statistics.median(c.normal_wait for c in costs):.3f} s")
    for cost in costs[2:]:
        ratio = cost.core_cpu_seconds / plain.core_cpu_seconds
        within = cost.longest_wait <= plain.longest_wait * 1.1  # a tenth for the noise of a shared machine
        print(
            f"{cost.name}: {ratio:.2f}x the fresh prefill's core CPU time (target <= {TARGET_RATIO:g}x: "
            f"{'ok' if ratio <= TARGET_RATIO else 'MISSED'}); longest wait {cost.longest_wait:.2f} s against "
            f"{plain.longest_wait:.2f} s for one full-budget step ({'ok' if within else 'LONGER'})"
        )
