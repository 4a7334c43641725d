"""Speculative decoding (n-gram prompt lookup, or a draft model): output tok/s with and without it, and against
llama-server on the same GGUF.

Two workloads on the embedded SmolLM2 (or --model), greedy, up to 256 output tokens each:
- grounded: summarize / rewrite / extract from a ~500-token article (benchmarks/prompts/speculative_source.txt),
  where the output copies runs of the prompt and proposals are accepted;
- open-ended: short stories, where they mostly are not (the cost of trying).

One stream: the contenders (pagedserve without speculation, with it, and llama-server with --llama-server PATH)
take turns request by request, each prompt of a round in turn, so that a shared machine's slow moments fall on
all of them; every round prints each one's tok/s and the ratios of that round (runs minutes apart on a busy
machine are not comparable), and the medians over the rounds close the table. Also printed: the cost of an output
token with speculation as a multiple of plain decoding's, and the acceptance (accepted of proposed tokens, and
the mean tokens a verifying step produced).

--streams N (32 by default, 0: none): N requests at once, each workload's prompts repeated, with and without
speculation, alternating; the cost of speculation there (the batch-aware rule's job: <= 5%).

--method draft proposes with --draft-model, by default the target itself: every proposal is accepted, so the
cost of a verified token against plain decoding's is the draft method's overhead ceiling.

    python -m benchmarks.speculative [--method ngram|draft] [--rounds 3] [--streams 32]
        [--llama-server /tmp/llama-server] [--max-tokens 256] [--num-speculative-tokens 4] [engine flags]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.speculative_peer import describe_flags, started_llama_server
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
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
WORKLOADS = {"grounded": GROUNDED, "open-ended": OPEN_ENDED}
Contender = Callable[[str, int], tuple[int, float]]  # (prompt, max tokens) -> (output tokens, seconds)


def llm_contender(llm: LLM) -> Contender:
    def chat(prompt: str, max_tokens: int) -> tuple[int, float]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0)  # greedy: the same tokens either way
        start = time.perf_counter()
        output = llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)[0]
        return len(output.outputs[0].token_ids), time.perf_counter() - start

    return chat


def speculative_config(config: EngineConfig, method: str) -> EngineConfig:
    """The config that speculates with `method` (draft: the target as its own draft unless one is named)."""
    if method == "ngram":
        return config.replace(speculative_method="ngram", draft_model=None)
    draft = config.draft_model or config.model or str(embedded_gguf_path())
    return config.replace(speculative_method="draft", draft_model=draft)


def one_stream(contenders: dict[str, Contender], spec: LLM, rounds: int, max_tokens: int) -> None:
    names = list(contenders)
    ratios = [(a, b) for a, b in (("spec", "plain"), ("spec", "llama"), ("plain", "llama")) if {a, b} <= set(names)]
    for workload, prompts in WORKLOADS.items():
        for prompt in prompts:  # warm-up, and every prompt into every contender's cache
            for contender in contenders.values():
                contender(prompt, 1)
        spec.stats(reset=True)
        print(f"\n{workload}, one stream: tok/s of each round (tokens), ratios of the same round")
        labels = [f"{n + ' tok/s':>16}" for n in names] + [f"{a + '/' + b:>13}" for a, b in ratios]
        print("round " + " ".join(labels))
        per_round: list[dict[str, float]] = []
        for round_ in range(rounds):
            totals = {name: [0, 0.0] for name in names}
            for prompt in prompts:
                for name in names:  # turns, request by request
                    tokens, seconds = contenders[name](prompt, max_tokens)
                    totals[name][0] += tokens
                    totals[name][1] += seconds
            speeds = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
            per_round.append(speeds)
            cells = " ".join(f"{speeds[n]:>9.1f} ({int(totals[n][0]):>4})" for n in names)
            print(f"{round_ + 1:>5} {cells} " + " ".join(f"{speeds[a] / speeds[b]:>12.2f}x" for a, b in ratios))
        medians = {n: statistics.median(r[n] for r in per_round) for n in names}
        ratio_medians = [statistics.median(r[a] / r[b] for r in per_round) for a, b in ratios]
        cells = [f"{medians[n]:>16.1f}" for n in names] + [f"{r:>12.2f}x" for r in ratio_medians]
        print("  med " + " ".join(cells))
        s = spec.stats().speculation
        accepted = s.num_accepted_tokens / max(1, s.num_draft_tokens)
        per_step = (s.num_accepted_tokens + s.num_drafts) / max(1, s.num_drafts)
        cost = statistics.median(r["plain"] / r["spec"] for r in per_round)
        print(f"      cost of a token with speculation {cost:.2f}x plain decoding's; accepted {accepted:.0%} of "
              f"proposals, {per_step:.2f} tokens a verifying step")  # fmt: skip


def many_streams(plain: LLM, spec: LLM, streams: int, rounds: int, max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    print(f"\n{streams} streams at once (each workload's prompts repeated): output tok/s, alternating")
    print(f"{'workload':<11} {'plain tok/s':>11} {'spec tok/s':>10} {'cost':>6}  (per round: spec / plain)")
    for workload, prompts in WORKLOADS.items():
        batch = [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(streams)]
        speeds: dict[str, list[float]] = {"plain": [], "spec": []}
        for _ in range(rounds):
            for name, llm in (("plain", plain), ("spec", spec)):
                start = time.perf_counter()
                outputs = llm.chat(batch, params, use_tqdm=False)
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                speeds[name].append(tokens / (time.perf_counter() - start))
        ratios = [s / p for s, p in zip(speeds["spec"], speeds["plain"])]
        base, fast = statistics.median(speeds["plain"]), statistics.median(speeds["spec"])
        cost = 1 / statistics.median(ratios)
        print(f"{workload:<11} {base:>11.1f} {fast:>10.1f} {cost:>5.2f}x  ({', '.join(f'{r:.2f}' for r in ratios)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each workload's prompts")
    parser.add_argument("--streams", type=int, default=32, help="the many-streams check's batch (0: skip it)")
    parser.add_argument("--llama-server", metavar="PATH", help="llama-server's binary: a third contender")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's threads (pagedserve: its own)")
    add_engine_args(parser, exclude=frozenset({"speculative_method"}))
    args = parser.parse_args()
    config = engine_config(args)
    spec_config = speculative_config(config, args.method)
    plain_config = config.replace(speculative_method=None, draft_model=None)
    k = spec_config.num_speculative_tokens
    proposer = f"n-grams {spec_config.ngram_min}-{spec_config.ngram_max}" if args.method == "ngram" else (
        f"draft {spec_config.draft_model}")  # fmt: skip
    print(f"k {k}, {proposer}, up to {args.max_tokens} tokens a request, greedy")
    with contextlib.ExitStack() as stack:
        plain = stack.enter_context(LLM.from_config(plain_config))
        spec = stack.enter_context(LLM.from_config(spec_config))
        contenders = {"plain": llm_contender(plain), "spec": llm_contender(spec)}
        if args.llama_server:
            model = Path(config.model) if config.model else embedded_gguf_path()
            log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "llama-server.log"
            peer = stack.enter_context(started_llama_server(args.llama_server, model, args.threads, log))
            print(f"llama: {describe_flags(args.llama_server, model, args.threads)}")
            contenders["llama"] = peer.chat
        one_stream(contenders, spec, args.rounds, args.max_tokens)
        if args.streams:
            many_streams(plain, spec, args.streams, max(2, args.rounds - 1), args.max_tokens)


if __name__ == "__main__":
    main()
