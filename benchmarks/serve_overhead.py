"""Serving overhead with one streaming client: what the HTTP layer adds on top of the engine's own work.

Starts a server on 127.0.0.1 in this process, streams completions from it, and records every engine step
(an EngineObserver), so both sides of each figure come from the same run:

- TTFT overhead: the client's time to first token minus the prefill step that produced it (target < 15 ms);
- chunk gap / step: the mean gap between streamed chunks over the mean decode step (target <= 1.10).

    python -m benchmarks.serve_overhead [--prompt-tokens 256] [--max-tokens 64] [--runs 5] [any engine flag]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import httpx

from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.client.async_stream import EngineObserver
from pagedserve.server import ServerSettings, create_app
from pagedserve.server.engine_args import add_engine_args, engine_config
from tests.background import BackgroundServer

MODEL = "bench"
TTFT_OVERHEAD_TARGET_MS = 15.0
GAP_RATIO_TARGET = 1.10


class StepLog(EngineObserver):
    """Every engine step's duration and token count (appended on the engine thread)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def on_step(self, seconds: float, num_tokens: int) -> None:
        with self._lock:
            self.steps.append((seconds, num_tokens))

    def take(self) -> list[tuple[float, int]]:
        with self._lock:
            steps, self.steps = self.steps, []
        return steps


@dataclass
class Run:
    ttft: float  # client: request sent -> first token chunk
    gaps: list[float]  # client: between token chunks
    prefill_step: float  # engine: the step that computed the prompt
    decode_steps: list[float]  # engine: the steps after it


def stream_once(client: httpx.Client, prompt: list[int], max_tokens: int, log: StepLog) -> Run:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    log.take()
    arrivals = []
    start = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["finish_reason"] is None:
                arrivals.append(time.perf_counter())
    steps = log.take()
    prefill = [seconds for seconds, tokens in steps if tokens > 1]
    assert len(prefill) == 1, f"expected one prefill step, got {len(prefill)}: raise --max-num-batched-tokens"
    return Run(
        ttft=arrivals[0] - start,
        gaps=[later - earlier for earlier, later in itertools.pairwise(arrivals)],
        prefill_step=prefill[0],
        decode_steps=[seconds for seconds, tokens in steps if tokens == 1],
    )


def report(runs: list[Run], args: argparse.Namespace) -> None:
    def median_ms(values: list[float]) -> float:
        return 1000 * statistics.median(values)

    ttft = median_ms([r.ttft for r in runs])
    prefill = median_ms([r.prefill_step for r in runs])
    overhead = median_ms([r.ttft - r.prefill_step for r in runs])
    gap = median_ms([g for r in runs for g in r.gaps])
    step = median_ms([s for r in runs for s in r.decode_steps])
    ratio = statistics.median(statistics.mean(r.gaps) / statistics.mean(r.decode_steps) for r in runs)
    shape = f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens out, {args.runs} runs"
    print(f"\nserving overhead, 1 streaming client: {shape} (medians)\n")
    rows: list[tuple[str, str, str, bool | None]] = [
        ("time to first token (client)", f"{ttft:.1f} ms", "", None),
        ("prefill step (engine)", f"{prefill:.1f} ms", "", None),
        (
            "TTFT overhead",
            f"{overhead:.1f} ms",
            f"< {TTFT_OVERHEAD_TARGET_MS:.0f} ms",
            overhead < TTFT_OVERHEAD_TARGET_MS,
        ),
        ("chunk gap (client)", f"{gap:.2f} ms", "", None),
        ("decode step (engine)", f"{step:.2f} ms", "", None),
        ("chunk gap / decode step", f"{ratio:.3f}", f"<= {GAP_RATIO_TARGET:.2f}", ratio <= GAP_RATIO_TARGET),
    ]
    print(f"{'metric':<30} {'value':>12}  {'target':<10}")
    for name, value, target, met in rows:
        verdict = "" if met is None else "ok" if met else "MISSED"
        print(f"{name:<30} {value:>12}  {target:<10} {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    add_engine_args(parser)
    args = parser.parse_args()
    engine = AsyncEngine.from_config(engine_config(args)).start()
    log = StepLog()
    engine.add_observer(log)
    if not engine.wait_ready():
        sys.exit(f"the engine failed to load: {engine.unavailable_reason()}")
    rng = random.Random(0)  # a fresh prompt per run: no prefix-cache hits
    vocab = engine.limits.vocab_size
    try:
        app = create_app(engine, ServerSettings([MODEL]))
        with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=600) as client:
            prompts = [[rng.randrange(1000, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.runs + 1)]
            stream_once(client, prompts[0], args.max_tokens, log)  # warm-up
            runs = [stream_once(client, prompt, args.max_tokens, log) for prompt in prompts[1:]]
    finally:
        engine.shutdown()
    report(runs, args)


if __name__ == "__main__":
    main()
