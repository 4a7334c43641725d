"""Speculative decoding (n-gram prompt lookup, or a draft model): one stream's output tok/s with and without it.

Two workloads on the embedded SmolLM2 (or --model), greedy, 256 output tokens each, one request at a time:
- grounded: summarize / rewrite / extract from a ~500-token article (benchmarks/prompts/speculative_source.txt),
  where the output copies runs of the prompt and proposals are accepted;
- open-ended: short stories, where they mostly are not (the cost of trying).
For each it prints output tok/s without speculation, with it, the speed-up, the cost of an output token
(milliseconds, and with speculation as a multiple of plain decoding's) and the acceptance (accepted of
proposed tokens, and the mean tokens a verifying step produced).

--method draft proposes with --draft-model, by default the target itself: every proposal is accepted, so the
cost of a verified token against plain decoding's is the draft method's overhead ceiling (k draft forwards
and one verifying forward for k + 1 tokens).

    python -m benchmarks.speculative [--method ngram|draft] [--max-tokens 256] [--num-speculative-tokens 4]
        [--ngram-min 2] [--ngram-max 4] [--draft-model PATH] [engine flags]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import EngineStats
from pagedserve.engine.worker import embedded_gguf_path
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


def speculative_config(config: EngineConfig, method: str) -> EngineConfig:
    """The config that speculates with `method` (draft: the target as its own draft unless one is named)."""
    if method == "ngram":
        return config.replace(speculative_method="ngram", draft_model=None)
    draft = config.draft_model or config.model or str(embedded_gguf_path())
    return config.replace(speculative_method="draft", draft_model=draft)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    add_engine_args(parser, exclude=frozenset({"speculative_method"}))
    args = parser.parse_args()
    config = engine_config(args)
    spec = speculative_config(config, args.method)
    plain = config.replace(speculative_method=None, draft_model=None)
    proposer = f"n-grams {spec.ngram_min}-{spec.ngram_max}" if args.method == "ngram" else f"draft {spec.draft_model}"
    print(f"k {spec.num_speculative_tokens}, {proposer}, {args.max_tokens} tokens a request, one stream")
    print(f"{'workload':<11} {'tokens':>6} {'plain tok/s':>11} {args.method + ' tok/s':>12} {'speed-up':>8} ", end="")
    print(f"{'plain ms/tok':>12} {'spec ms/tok':>11} {'cost':>6} {'accepted':>8} {'tok/step':>8}")
    results = {}
    for name, cfg in (("plain", plain), ("spec", spec)):
        with LLM.from_config(cfg) as llm:
            run(llm, GROUNDED[:1], 16)  # warm-up
            results[name] = {
                w: run(llm, p, args.max_tokens) for w, p in (("grounded", GROUNDED), ("open-ended", OPEN_ENDED))
            }
    for workload in ("grounded", "open-ended"):
        tokens, seconds, _ = results["plain"][workload]
        spec_tokens, spec_seconds, stats = results["spec"][workload]
        s = stats.speculation
        accepted = s.num_accepted_tokens / max(1, s.num_draft_tokens)
        per_step = (s.num_accepted_tokens + s.num_drafts) / max(1, s.num_drafts)
        base, fast = tokens / seconds, spec_tokens / spec_seconds
        print(f"{workload:<11} {tokens:>6} {base:>11.1f} {fast:>12.1f} {fast / base:>7.2f}x ", end="")
        print(f"{1000 / base:>12.1f} {1000 / fast:>11.1f} {base / fast:>5.2f}x {accepted:>8.0%} {per_step:>8.2f}")


if __name__ == "__main__":
    main()
