"""Speculative decoding with n-gram prompt lookup: one stream's output tok/s with and without it.

Two workloads on the embedded SmolLM2 (or --model), greedy, 256 output tokens each, one request at a time:
- grounded: summarize / rewrite / extract from a ~500-token article (benchmarks/prompts/speculative_source.txt),
  where the output copies runs of the prompt and proposals are accepted;
- open-ended: short stories, where they mostly are not (the cost of trying).
For each it prints output tok/s without speculation, with it, the speed-up, and the acceptance (accepted of
proposed tokens, and the mean tokens a verifying step produced).

    python -m benchmarks.speculative [--max-tokens 256] [--num-speculative-tokens 4] [--ngram-min 2]
        [--ngram-max 4] [engine flags]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.core.llm_engine import EngineStats
from pagedserve.server.engine_args import add_engine_args, engine_config

SOURCE = (Path(__file__).parent / "prompts" / "speculative_source.txt").read_text()
GROUNDED = [
    f"Summarize the following article in one paragraph, keeping its names and figures.\n\n{SOURCE}",
    f"Rewrite the following article in plain, simple English, paragraph by paragraph.\n\n{SOURCE}",
    f"List every person, number and opening time in the following article, quoting each sentence they appear "
    f"in.\n\n{SOURCE}",
]
OPEN_ENDED = [
    "Write a short story about a fox who learns to play the violin.",
    "Write a short story about two astronauts who find a garden on Mars.",
    "Write a short story about a baker whose bread can make people remember their dreams.",
]


def run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[int, float, EngineStats]:
    """Output tokens, seconds and the engine's counters for the prompts, one at a time (a single stream)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)  # greedy: the same tokens either way
    llm.stats(reset=True)
    tokens, start = 0, time.perf_counter()
    for prompt in prompts:
        output = llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)[0]
        tokens += len(output.outputs[0].token_ids)
    return tokens, time.perf_counter() - start, llm.stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=256)
    add_engine_args(parser)
    args = parser.parse_args()
    config = engine_config(args)
    spec = config.replace(speculative_method="ngram") if config.speculative_method is None else config
    plain = config.replace(speculative_method=None)
    print(
        f"k {spec.num_speculative_tokens}, n-grams {spec.ngram_min}-{spec.ngram_max}, "
        f"{args.max_tokens} tokens a request, one stream"
    )
    print(f"{'workload':<11} {'tokens':>6} {'plain tok/s':>11} {'n-gram tok/s':>12} {'speed-up':>8} ", end="")
    print(f"{'accepted':>8} {'tok/step':>8}")
    results = {}
    for name, cfg in (("plain", plain), ("ngram", spec)):
        with LLM.from_config(cfg) as llm:
            run(llm, GROUNDED[:1], 16)  # warm-up
            results[name] = {
                w: run(llm, p, args.max_tokens) for w, p in (("grounded", GROUNDED), ("open-ended", OPEN_ENDED))
            }
    for workload in ("grounded", "open-ended"):
        tokens, seconds, _ = results["plain"][workload]
        spec_tokens, spec_seconds, stats = results["ngram"][workload]
        s = stats.speculation
        accepted = s.num_accepted_tokens / max(1, s.num_draft_tokens)
        per_step = (s.num_accepted_tokens + s.num_drafts) / max(1, s.num_drafts)
        base, fast = tokens / seconds, spec_tokens / spec_seconds
        print(f"{workload:<11} {tokens:>6} {base:>11.1f} {fast:>12.1f} {fast / base:>7.2f}x ", end="")
        print(f"{accepted:>8.0%} {per_step:>8.2f}")


if __name__ == "__main__":
    main()
