"""Gemma's KV memory: how many long sequences one KV budget holds with one block table for every layer (before)
and with KV cache groups whose windowed layers keep only their window's blocks (after).

    python -m benchmarks.hybrid_kv [--budget-gib 4] [--prompt-tokens 16384] [--output-tokens 256]

The real Scheduler and block managers run the requests (all arriving at once, prefill chunks of 2,048 tokens,
block 16); tokens are simulated: memory does not depend on which tokens come out. The layouts are the published
configs' (layers, window, KV heads, head_dim; bfloat16), the budget what each gets for its KV cache.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import torch

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduling.hybrid_kv_cache_manager import kv_cache_manager
from pagedserve.engine.scheduling.request import Request
from pagedserve.engine.scheduling.scheduler import Scheduler
from pagedserve.engine.worker.kv_groups import KVCacheGroups, kv_cache_groups, window_blocks
from pagedserve.engine.worker.kv_sizing import kv_bytes_per_block, longest_request
from pagedserve.engine.worker.models import ModelSpec

BLOCK_SIZE = 16
CHUNK = 2048


@dataclass(frozen=True)
class Layout:
    name: str
    num_layers: int
    global_every: int  # every n-th layer is global (Gemma 2: 2, Gemma 3: 6)
    window: int
    num_kv_heads: int
    head_dim: int

    def windows(self) -> list[int | None]:
        return [None if (i + 1) % self.global_every == 0 else self.window for i in range(self.num_layers)]

    def spec(self) -> ModelSpec:
        return ModelSpec(
            architecture="Gemma",
            vocab_size=256000,
            hidden_size=self.num_kv_heads * self.head_dim,
            intermediate_size=1,
            num_layers=self.num_layers,
            num_heads=self.num_kv_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            max_position_embeddings=131072,
            tie_word_embeddings=True,
            qkv_bias=False,
            qk_norm=False,
            sliding_window=None,
            eos_token_ids=(1,),
        )


LAYOUTS = [
    Layout("Gemma 2 2B", 26, 2, 4096, 4, 256),
    Layout("Gemma 2 9B", 42, 2, 4096, 8, 256),
    Layout("Gemma 3 1B", 26, 6, 512, 1, 256),
    Layout("Gemma 3 4B", 34, 6, 1024, 4, 256),
    Layout("Gemma 3 12B", 48, 6, 1024, 8, 256),
]


def peak_running(num_blocks: int, windows: tuple[int | None, ...], prompt: int, output: int, count: int) -> int:
    """Requests running at once at the peak, `count` of them arriving together."""
    kv = kv_cache_manager(num_blocks, BLOCK_SIZE, windows, enable_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=1024, max_num_batched_tokens=CHUNK, max_model_len=prompt + output + 1,
                          max_queue_len=count)  # fmt: skip
    rng = random.Random(0)
    for i in range(count):
        tokens = [rng.randrange(1000) for _ in range(prompt)]
        scheduler.add_request(Request(str(i), tokens, SamplingParams(), max_tokens=output))
    peak = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.update(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
        peak = max(peak, sum(1 for r in scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens))
    return peak


def measure(layout: Layout, budget: int, prompt: int, output: int) -> tuple[int, int, int]:
    """(sequences decoding at once before, after; the most a request may hold after)."""
    spec, dtype = layout.spec(), torch.bfloat16
    groups: KVCacheGroups = kv_cache_groups(layout.windows())
    before_blocks = budget // kv_bytes_per_block(spec, BLOCK_SIZE, dtype)
    after_blocks = budget // kv_bytes_per_block(spec, BLOCK_SIZE, dtype, groups)
    longest = longest_request(after_blocks, BLOCK_SIZE, groups, CHUNK)
    # more requests than the groups' blocks hold at full length: memory, not the queue, bounds the peak
    full_length = -(-(prompt + output) // BLOCK_SIZE)
    per_request = sum(full_length if w is None else window_blocks(w, 1, BLOCK_SIZE) for w in groups.windows)
    count = after_blocks // per_request + 4
    before = after = 0  # a request longer than the cache holds is refused
    if before_blocks * BLOCK_SIZE > prompt + output:
        before = peak_running(before_blocks, (None,), prompt, output, count)
    if longest > prompt + output:
        after = peak_running(after_blocks, groups.windows, prompt, output, count)
    return before, after, longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--output-tokens", type=int, default=256)
    args = parser.parse_args()
    budget = int(args.budget_gib * 2**30)
    print(
        f"KV budget {args.budget_gib:g} GiB (bfloat16), requests of {args.prompt_tokens} prompt + "
        f"{args.output_tokens} output tokens, block {BLOCK_SIZE}, prefill chunks of {CHUNK}"
    )
    print()
    print("| model layout | window | KV cache groups | sequences at once, one table | with groups | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for layout in LAYOUTS:
        before, after, _ = measure(layout, budget, args.prompt_tokens, args.output_tokens)
        groups = kv_cache_groups(layout.windows()).num_groups
        ratio = f"{after / before:.1f}x" if before else "-"
        print(f"| {layout.name} | {layout.window} | {groups} | {before} | {after} | {ratio} |")


if __name__ == "__main__":
    main()
