"""How OpenMP's wait policy moves offline throughput, on a quiet CPU and next to one busy process.

pagedserve sets OMP_WAIT_POLICY=PASSIVE unless the user chose one (engine/__init__.py): an OpenMP worker
sleeps as soon as a parallel region ends. The C kernels of a decode step run on their own pool
(kernels/csrc/parallel.c) and do not care; torch's own ops do, above all MKL's prefill matmuls, each of
which runs several regions. Waking a sleeping thread is slow on a virtual machine, so a short spin
(GOMP_SPINCOUNT, which libgomp honours whatever the policy) may pay on a machine the engine has to itself,
and costs dearly when another thread or process wants the core: the spinning worker then takes it from the
thread doing the work. This script measures both sides in one run: the same offline workload
(benchmarks/workloads.py chat prompts, greedy, ignore_eos) in a fresh process per setting, settings
interleaved over rounds, each with the machine otherwise quiet and with one busy-looping process.

    python -m benchmarks.omp_wait [--rounds 2] [--num-requests 16] [--output-len 64]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "sleep at once (default)": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin ~6 ms (GOMP_SPINCOUNT=100000)": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "100000"},
}
BUSY_LOOP = "while True: pass"


def child(num_requests: int, output_len: int) -> None:
    """Runs in the measured process: prints output tokens per second."""
    from benchmarks.throughput import pagedserve_run
    from benchmarks.workloads import chat_prompts
    from pagedserve.engine import LLM
    from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path
    from pagedserve.engine.worker.weights.gguf_files import dequantized_model_dir

    llm = LLM(model=str(dequantized_model_dir(embedded_gguf_path())), max_num_seqs=64, max_num_batched_tokens=2048)
    prompts = chat_prompts(llm.tokenizer, num_requests, 20, 400)
    pagedserve_run(llm, prompts[:4], 4)  # warm-up
    result, _ = pagedserve_run(llm, prompts, output_len)
    print(f"{result.tokens_per_second:.2f}")


def measure(setting: dict[str, str], busy: bool, args: argparse.Namespace) -> float:
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(setting)
    command = [sys.executable, "-m", "benchmarks.omp_wait", "--child", str(args.num_requests), str(args.output_len)]
    hog = subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) if busy else None
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    print(f"{args.num_requests} requests x {args.output_len} output tokens, {os.cpu_count()} CPUs, {time.ctime()}")
    print("| setting | machine | output tok/s, each round |")
    print("|---|---|---|")
    results: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.rounds):
        for busy in (False, True):
            for name, setting in SETTINGS.items():
                results.setdefault((name, busy), []).append(measure(setting, busy, args))
    for (name, busy), rates in results.items():
        machine = "one busy process beside" if busy else "quiet"
        print(f"| {name} | {machine} | {', '.join(f'{rate:.1f}' for rate in rates)} |")


if __name__ == "__main__":
    main()
