"""Where a decode step spends its time: the native decoder's layers, the LM head, the sampler and the rest of the
engine's step, on any model (a GGUF file as it is served), for one stream or --streams decoding together.

The engine core runs on a thread of this process (LLM.from_config with the model loaded here) and each piece
is timed where it is called, over the requests' greedy tokens after a warm-up request. --cpu-time times the
core thread's CPU time instead of the wall clock: with one thread that is the work itself (arithmetic and
waits on memory), which a machine shared with other work does not inflate as it does the wall clock.

    python -m benchmarks.gguf_models --shape 1b --mix q4_0 --out /tmp/llama-1b-q4_0.gguf
    python -m benchmarks.decode_profile /tmp/llama-1b-q4_0.gguf [--threads 1 --cpu-time] [--tokens 64] [--streams 8]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the engine sets it (engine/openmp_policy.py)

import torch

from benchmarks.quantized_linear import cpu_model
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core import llm_engine, sampler
from pagedserve.engine.worker import native_decoder
from pagedserve.engine.worker.model_loader import load_model
from pagedserve.engine.worker.models import llama

PIECES = (  # (owner, method, label), the engine step last: it holds the others
    (native_decoder.CpuDecoder, "forward", "layers (native decoder)"),
    (llama.LlamaForCausalLM, "compute_logits", "LM head"),
    (sampler.Sampler, "__call__", "sampler"),
    (llm_engine.LLMEngine, "step", "engine step"),
)


class Timings:
    """Seconds and calls per piece, as the pieces' wrappers add them."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, owner: type, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.clock()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += self.clock() - start
                self.calls[label] += 1

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def milliseconds(self, label: str) -> float:
        return self.seconds[label] / max(self.calls[label], 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=1, help="requests decoding together (a step's tokens)")
    parser.add_argument("--activation-dtype", default="auto")
    parser.add_argument("--cpu-time", action="store_true", help="the core thread's CPU time, not the wall clock")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    timings = Timings(time.thread_time if args.cpu_time else time.perf_counter)
    for owner, name, label in PIECES:
        timings.wrap(owner, name, label)
    config = EngineConfig(
        model=args.model, num_threads=args.threads, activation_dtype=args.activation_dtype, max_model_len=2048
    )
    llm = LLM.from_config(config, load_model(config))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(["Hello"], params, use_tqdm=False)  # warm-up
    timings.clear()
    start = time.perf_counter()
    prompts = [f"Question {i}: what is the capital of France?" for i in range(args.streams)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.close()
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    clock = "one thread's CPU time" if args.cpu_time else "wall clock"
    now = datetime.datetime.now(datetime.timezone.utc)
    print(
        f"{cpu_model()}, {args.threads} threads, {args.streams} streams, {clock}; {now:%Y-%m-%d %H:%M} UTC, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(f"{tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tok/s (wall clock)\n")
    print("| piece | ms a step |")
    print("|---|---:|")
    parts = [label for _, _, label in PIECES[:-1]]
    for label in parts:
        print(f"| {label} | {timings.milliseconds(label):.2f} |")
    step = timings.milliseconds("engine step")
    print(f"| the rest of the engine step | {step - sum(map(timings.milliseconds, parts)):.2f} |")
    print(f"| engine step | {step:.2f} |")


if __name__ == "__main__":
    main()
