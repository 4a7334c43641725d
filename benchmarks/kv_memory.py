"""KV memory: what paging, prefix caching and shared parallel samples save, measured in one run.

    python -m benchmarks.kv_memory [--skip-model]   # the table, plus benchmarks/results/kv_memory.png

1. ShareGPT-like lengths, one KV budget: the real Scheduler and KVCacheManager (block 16) against a
   contiguous allocator that reserves max_model_len per request, as servers did before paging. Token
   generation is simulated (memory does not depend on which tokens come out; lengths are unknown in advance).
2. 32 requests behind one 1,000-token system prompt, with and without prefix caching (the real model).
3. n=8 parallel samples against 8 independent requests: KV blocks at the peak (the real engine).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.workloads import filler_text, sharegpt_like_lengths
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.scheduling.kv_cache_manager import KVCacheManager
from pagedserve.engine.scheduling.request import Request
from pagedserve.engine.scheduling.scheduler import Scheduler

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class MemoryResult:
    name: str
    peak_running: int
    slot_use_at_peak: float  # tokens stored / slots allocated, at the step with the most slots allocated
    steps: int


def simulate_paged(
    lengths: list[tuple[int, int]], budget_tokens: int, max_model_len: int, block_size: int = 16
) -> MemoryResult:
    kv = KVCacheManager(budget_tokens // block_size, block_size, enable_caching=False)
    scheduler = Scheduler(
        kv, max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=max_model_len, max_queue_len=len(lengths)
    )
    rng = random.Random(1)
    for i, (prompt_len, output_len) in enumerate(lengths):
        tokens = [rng.randrange(1000) for _ in range(prompt_len)]
        scheduler.add_request(Request(str(i), tokens, SamplingParams(), max_tokens=output_len))
    peak_running, peak_slots, use_at_peak, steps = 0, 0, 0.0, 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.update(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
        steps += 1
        slots = (kv.num_blocks - kv.pool.num_free) * block_size
        stored = sum(r.num_computed_tokens for r in scheduler.running)
        peak_running = max(peak_running, scheduler.num_running)
        if slots > peak_slots:
            peak_slots, use_at_peak = slots, stored / slots
    return MemoryResult(f"pagedserve (paged, block {block_size})", peak_running, use_at_peak, steps)


def simulate_contiguous(lengths: list[tuple[int, int]], budget_tokens: int, max_model_len: int) -> MemoryResult:
    """Each admitted request reserves max_model_len slots until it finishes; one token per step each."""
    capacity = budget_tokens // max_model_len
    waiting = list(lengths)
    running: list[list[int]] = []  # [tokens stored, tokens it will reach]
    peak_running, use_at_peak, steps = 0, 0.0, 0
    while waiting or running:
        while waiting and len(running) < capacity:
            prompt_len, output_len = waiting.pop(0)
            running.append([prompt_len, prompt_len + output_len])
        for entry in running:
            entry[0] += 1
        steps += 1
        if len(running) >= peak_running:
            peak_running = len(running)
            use_at_peak = sum(e[0] for e in running) / (len(running) * max_model_len)
        running = [e for e in running if e[0] < e[1]]
    return MemoryResult(f"contiguous ({max_model_len} reserved per request)", peak_running, use_at_peak, steps)


def shared_prefix_speedup(llm_factory, num_requests: int = 32, prefix_tokens: int = 1000) -> tuple[float, float]:
    rng = random.Random(2)
    system = "You are a careful assistant. " + filler_text(rng, prefix_tokens)
    questions = [f"Question {i}: {filler_text(rng, 8)}?" for i in range(num_requests)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    seconds = []
    for caching in (True, False):
        llm = llm_factory(enable_prefix_caching=caching)
        system_ids = llm.tokenizer.encode(system)[:prefix_tokens]
        prompts = [system_ids + llm.tokenizer.encode(q, add_special_tokens=False) for q in questions]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    return seconds[0], seconds[1]


def parallel_sampling_blocks(
    llm_factory, n: int = 8, prompt_tokens: int = 500, output_tokens: int = 64
) -> tuple[int, int]:
    rng = random.Random(3)
    peaks = []
    for grouped in (True, False):
        llm = llm_factory(enable_prefix_caching=False)
        prompt = llm.tokenizer.encode(filler_text(rng, prompt_tokens))[:prompt_tokens]
        engine = llm.engine
        if grouped:
            engine.add_request("group", prompt, SamplingParams(n=n, max_tokens=output_tokens, ignore_eos=True, seed=0))
        else:
            for i in range(n):
                engine.add_request(
                    f"single{i}", prompt, SamplingParams(max_tokens=output_tokens, ignore_eos=True, seed=i)
                )
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.kv.num_blocks - engine.kv.pool.num_free)
        peaks.append(peak)
    return peaks[0], peaks[1]


def plot(paged: MemoryResult, contiguous: MemoryResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["contiguous", "paged"]
    axes[0].bar(names, [contiguous.slot_use_at_peak * 100, paged.slot_use_at_peak * 100], color=["#999", "#2a7"])
    axes[0].set_ylabel("% of KV slots holding tokens (peak)")
    axes[1].bar(names, [contiguous.peak_running, paged.peak_running], color=["#999", "#2a7"])
    axes[1].set_ylabel("requests running at once (peak)")
    fig.suptitle("Same KV budget, ShareGPT-like lengths")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--budget-tokens", type=int, default=65536)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--skip-model", action="store_true", help="only the simulated allocator comparison")
    args = parser.parse_args()

    lengths = sharegpt_like_lengths(args.num_requests, args.max_model_len, seed=0)
    paged = simulate_paged(lengths, args.budget_tokens, args.max_model_len)
    paged_small_blocks = simulate_paged(lengths, args.budget_tokens, args.max_model_len, block_size=8)
    contiguous = simulate_contiguous(lengths, args.budget_tokens, args.max_model_len)
    mean_prompt = sum(p for p, _ in lengths) / len(lengths)
    mean_output = sum(o for _, o in lengths) / len(lengths)
    print(
        f"ShareGPT-like workload: {len(lengths)} requests, mean prompt {mean_prompt:.0f}, mean output "
        f"{mean_output:.0f} tokens, max_model_len {args.max_model_len}, KV budget {args.budget_tokens} token slots"
    )
    print()
    print("| allocator | peak requests running | KV slots holding tokens at the peak |")
    print("|---|---:|---:|")
    for result in (contiguous, paged, paged_small_blocks):
        print(f"| {result.name} | {result.peak_running} | {result.slot_use_at_peak:.1%} |")
    print(f"\npaged runs {paged.peak_running / contiguous.peak_running:.1f}x as many requests at once")
    plot(paged, contiguous, RESULTS / "kv_memory.png")
    if args.skip_model:
        return

    def llm_factory(**overrides) -> LLM:
        return LLM(max_num_seqs=64, max_model_len=2048, **overrides)

    cached, uncached = shared_prefix_speedup(llm_factory)
    grouped, independent = parallel_sampling_blocks(llm_factory)
    print()
    print("| workload | with sharing | without | ratio |")
    print("|---|---:|---:|---:|")
    print(
        f"| 32 requests, shared 1,000-token system prompt: seconds | {cached:.1f} | {uncached:.1f} | "
        f"{uncached / cached:.1f}x faster |"
    )
    print(
        f"| n=8 samples of a 500-token prompt, 64 tokens each: peak KV blocks | {grouped} | {independent} | "
        f"{grouped / independent:.0%} of the blocks |"
    )


if __name__ == "__main__":
    main()
