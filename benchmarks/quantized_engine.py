"""The embedded GGUF served offline with its projections as stored blocks against the same dequantized to float32.

Two `LLM`s on the embedded SmolLM2 (Q4_1, Q8_0 head): `quantization="auto"` (the blocks) and `"none"` (float32).
Each workload runs on both in turn, ROUNDS times (A B A B ...), greedy with ignore_eos so every request makes
exactly its tokens; the best round of each is reported, with the ratio and whether the tokens were the same.

    python -m benchmarks.quantized_engine [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

from pagedserve.engine import LLM, SamplingParams

WORKLOADS = {  # name -> (streams, output tokens each)
    "one stream": (1, 128),
    "32 streams": (32, 96),
}
MODES = ("auto", "none")


def conversations(streams: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Tell me fact number {i} about the ocean."}] for i in range(streams)]


def timed(llm: LLM, streams: int, tokens: int) -> tuple[float, list[list[int]]]:
    """Output tokens per second of one run, and the tokens of each stream."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.chat(conversations(streams), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    token_ids = [list(output.outputs[0].token_ids) for output in outputs]
    return sum(map(len, token_ids)) / seconds, token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engines = {mode: LLM(quantization=mode, num_threads=args.threads) for mode in MODES}
    for llm in engines.values():
        timed(llm, 2, 4)  # warm-up: kernels built, first steps out of the way
    now = datetime.datetime.now(datetime.UTC)
    print("# Stored blocks against dequantized float32, offline\n")
    print(f"- {now:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, {args.threads} threads, best of {args.rounds} rounds\n")
    print("| workload | blocks tok/s | float32 tok/s | blocks / float32 | same tokens |")
    print("|---|---:|---:|---:|---|")
    for name, (streams, tokens) in WORKLOADS.items():
        best = dict.fromkeys(MODES, 0.0)
        outputs: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for mode, llm in engines.items():
                rate, outputs[mode] = timed(llm, streams, tokens)
                best[mode] = max(best[mode], rate)
        same = "yes" if outputs["auto"] == outputs["none"] else "no"
        print(f"| {name} | {best['auto']:.1f} | {best['none']:.1f} | {best['auto'] / best['none']:.2f}x | {same} |")
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
