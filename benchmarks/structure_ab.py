"""A/B of the process layout against an earlier commit, in one run: offline throughput by import order, and
serving throughput at 32 concurrent chat streams.

    python -m benchmarks.structure_ab --baseline COMMIT [--pairs 3] [--skip-offline] [--skip-serving]
                                      [--baseline-flags "..."] [--current-flags "..."]

The baseline is checked out into a temporary git worktree and imported through a `pagedserve` link to it
(PYTHONPATH wins over the editable install). Runs alternate baseline/current pair by pair, each in fresh
processes, so the ratios compare runs minutes apart on the same machine.

Offline: `LLM.generate`, 64 requests x 64 greedy tokens on the embedded model, with `torch` and
`transformers` imported before pagedserve (what most programs do) or after it; OMP_WAIT_POLICY unset.
Serving: `pagedserve serve` then `pagedserve bench serve --endpoint-type chat --max-concurrency 32`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.servers import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = """
import json, sys, time
if sys.argv[1] == "torch-first":
    import torch, transformers  # noqa: F401
from pagedserve import LLM, SamplingParams
from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path, materialize_gguf
llm = LLM(model=str(materialize_gguf(embedded_gguf_path())), max_num_seqs=64)
words = "the quick brown fox jumps over the lazy dog and runs far away into the woods".split()
prompts = [llm.tokenizer.encode(" ".join(words[: 4 + i % 12]) + f" {i}") for i in range(64)]
llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
start = time.perf_counter()
outputs = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - start
print(json.dumps({"tok_s": sum(len(o.outputs[0].token_ids) for o in outputs) / seconds}))
"""


def checkout(commit: str, folder: Path) -> Path:
    """A worktree of `commit` and a folder to put on PYTHONPATH that imports it as `pagedserve`."""
    tree = folder / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True)
    (folder / "path").mkdir()
    (folder / "path" / "pagedserve").symlink_to(tree)
    return folder / "path"


def environment(pythonpath: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "PYTHONPATH")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def offline(pythonpath: Path | None, order: str) -> float:
    result = subprocess.run(
        [sys.executable, "-c", OFFLINE, order], env=environment(pythonpath), cwd="/", capture_output=True, text=True
    )
    if result.returncode:
        sys.exit(f"offline run failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["tok_s"]


def serving(pythonpath: Path | None, scratch: Path, extra_flags: list[str]) -> float:
    port = free_port()
    env = environment(pythonpath)
    flags = ["--port", str(port), "--max-num-seqs", "32", "--log-level", "warning", *extra_flags]
    server = subprocess.Popen([sys.executable, "-m", "pagedserve.server.cli", "serve", *flags], env=env, cwd="/")
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_ready(server, url, timeout=300), "the server did not start"
        saved = scratch / f"serve-{time.monotonic_ns()}.json"
        bench = ["--base-url", url, "--endpoint-type", "chat", "--num-prompts", "96", "--max-concurrency", "32"]
        bench += ["--input-len", "128", "--output-len", "128", "--disable-tqdm", "--save-result", str(saved)]
        subprocess.run(
            [sys.executable, "-m", "pagedserve.server.cli", "bench", "serve", *bench],
            env=env,
            cwd="/",
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(saved.read_text())["output_throughput"]
    finally:
        server.terminate()
        server.wait(60)


def report(name: str, current: list[float], baseline: list[float]) -> None:
    ratios = [c / b for c, b in zip(current, baseline)]
    print(
        f"| {name} | {statistics.median(baseline):.1f} | {statistics.median(current):.1f} | "
        f"{' '.join(f'{r:.2f}x' for r in ratios)} | {statistics.median(ratios):.2f}x |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the commit to compare with")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--baseline-flags", default="", help="extra `pagedserve serve` flags for the baseline")
    parser.add_argument("--current-flags", default="", help="extra `pagedserve serve` flags for the working tree")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="structure-ab-"))
    baseline = checkout(args.baseline, scratch)
    try:
        print(f"baseline {args.baseline} vs the working tree; {args.pairs} pairs; {os.cpu_count()} CPUs")
        print("| figure | baseline (median) | current (median) | current / baseline, pair by pair | median |")
        print("|---|---:|---:|---|---:|")
        if not args.skip_offline:
            runs: dict[tuple[str, str], list[float]] = {}
            for _ in range(args.pairs):
                for order in ("pagedserve-first", "torch-first"):
                    for tree, path in (("baseline", baseline), ("current", None)):
                        runs.setdefault((tree, order), []).append(offline(path, order))
            for order in ("pagedserve-first", "torch-first"):
                report(f"offline tok/s, {order}", runs[("current", order)], runs[("baseline", order)])
            report(
                "offline tok/s: current torch-first vs baseline pagedserve-first",
                runs[("current", "torch-first")],
                runs[("baseline", "pagedserve-first")],
            )
            within = [t / p for t, p in zip(runs[("current", "torch-first")], runs[("current", "pagedserve-first")])]
            print(f"current torch-first / pagedserve-first: {' '.join(f'{r:.2f}x' for r in within)}")
        if not args.skip_serving:
            served: dict[str, list[float]] = {"baseline": [], "current": []}
            for _ in range(args.pairs):
                served["baseline"].append(serving(baseline, scratch, args.baseline_flags.split()))
                served["current"].append(serving(None, scratch, args.current_flags.split()))
            report("serving output tok/s, 32 concurrent chat streams", served["current"], served["baseline"])
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(scratch / "tree")], check=False)


if __name__ == "__main__":
    main()
