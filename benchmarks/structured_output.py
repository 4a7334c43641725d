"""Structured output on the embedded model: a corpus of JSON schemas, the cost of masking, jump-forward.

Three parts, each printed as a markdown table:

1. Schema corpus. Every schema of tests/structured_corpus.py (nested objects, arrays with bounds, enums, const,
   anyOf/oneOf, $ref/$defs, string patterns and formats, numeric ranges, optional fields, nulls, string length
   bounds, and the shapes the openai SDK's `parse()` makes from Pydantic models) is asked for with its own chat
   prompt, at temperature 0 and at temperature 1 (seeded), all requests of one temperature in one batch. Every output
   that ends with `stop` is validated with jsonschema (Draft 2020-12, formats checked); all must be valid.
   A schema the library refuses is reported with its reason, not dropped.
2. Overhead. Concurrent greedy JSON-schema requests (jump-forward off, so only masking differs) against the
   same prompts unconstrained with the same output lengths (min_tokens = max_tokens = the constrained
   output's length, ignore_eos), run alternately three times each; the best wall clock of each gives the
   tokens/s ratio (target: constrained >= 0.90x of unconstrained).
3. Jump-forward. The corpus at temperature 0 with jump-forward on and off (two engines, one idle while the
   other runs, three alternating runs each): the token ids must be equal; the table gives engine steps, the
   best wall clock and the speed-up. Part 1's temperature-0 outputs are the first run with it on.

    python -m benchmarks.structured_output            # 7-14 minutes on 2 CPU cores, by their load
    python -m benchmarks.structured_output --quick    # 8 schemas, 8 concurrent requests: a smoke run

Before each timed run the engine has seen every prompt and constraint once (prefix cache and compiled grammars
warm), so the timings are of decoding.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as engine/__init__.py does, before torch loads

import jsonschema
import torch

from pagedserve.engine import LLM, RequestOutput, SamplingParams, StructuredOutput
from pagedserve.engine.core.messages import EngineSnapshot, Ready, Reply, StepOutput
from pagedserve.engine.structured.grammar import GrammarCompiler
from tests.structured_corpus import CORPUS, FORMAT_CHECKER, Case

OVERHEAD_TARGET = 0.90


# ---- running and checking -----------------------------------------------------------------------------


class SnapshotLLM(LLM):
    """LLM that keeps the engine core's latest counters (mask time, jump-forward tokens), which every step's
    output carries but LLM does not expose."""

    snapshot = EngineSnapshot()

    def _receive(self) -> Ready | StepOutput | Reply:
        message = super()._receive()
        if isinstance(message, StepOutput):
            self.snapshot = message.snapshot
        return message


@dataclass
class Run:
    """One timed batch: its outputs, wall clock and engine steps."""

    outputs: list[RequestOutput]
    seconds: float
    steps: int

    @property
    def token_ids(self) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in self.outputs]

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def mean_latency(self) -> float:
        """Seconds from submission to the last token, averaged over the requests."""
        latencies = [o.outputs[0].metrics.e2e_latency for o in self.outputs if o.outputs[0].metrics]
        return sum(lat or 0.0 for lat in latencies) / max(1, len(latencies))


def messages(case: Case) -> list[dict[str, str]]:
    return [{"role": "user", "content": case.prompt}]


def schema_params(case: Case, temperature: float, seed: int, max_tokens: int) -> SamplingParams:
    constraint = StructuredOutput.json_schema(case.schema)
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, structured_output=constraint)


def timed_chat(llm: LLM, cases: Sequence[Case], params: Sequence[SamplingParams]) -> Run:
    llm.stats(reset=True)
    start = time.perf_counter()
    outputs = llm.chat([messages(c) for c in cases], list(params), use_tqdm=False)
    seconds = time.perf_counter() - start
    return Run(outputs, seconds, llm.stats().num_steps)


def warm(llm: LLM, cases: Sequence[Case]) -> None:
    """One token for every prompt under its constraint: prompts in the prefix cache, grammars compiled."""
    llm.chat([messages(c) for c in cases], [schema_params(c, 0.0, 0, 1) for c in cases], use_tqdm=False)


def refusals(llm: LLM, cases: Sequence[Case]) -> dict[str, str]:
    """Schema name -> the library's reason, for the schemas the engine would refuse at generate."""
    compiler = GrammarCompiler(llm.tokenizer, llm.info.limits.vocab_size, frozenset())
    refused = {}
    for case in cases:
        try:
            compiler.check(StructuredOutput.json_schema(case.schema))
        except ValueError as exc:
            refused[case.name] = str(exc)
    return refused


def validation_error(schema: dict[str, Any], text: str) -> str | None:
    """Why `text` is not a valid instance of `schema` (None: it is)."""
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema, format_checker=FORMAT_CHECKER).iter_errors(instance)
    )
    return None if error is None else f"{error.message} (at {error.json_path})"


def repeats_header(runs: Sequence[Run]) -> str:
    return f"best of {len(runs)} (s) | all {len(runs)} (s)"


# ---- part 1: the corpus ---------------------------------------------------------------------------------


@dataclass
class CorpusResult:
    temperature: float
    cases: list[Case]
    outputs: list[RequestOutput]

    def finished(self, reason: str) -> list[int]:
        return [i for i, o in enumerate(self.outputs) if o.outputs[0].finish_reason == reason]

    def invalid(self) -> list[tuple[str, str, str]]:
        """(name, error, text) of every output that ended with stop and is not a valid instance."""
        found = []
        for i in self.finished("stop"):
            text = self.outputs[i].outputs[0].text
            error = validation_error(self.cases[i].schema, text)
            if error is not None:
                found.append((self.cases[i].name, error, text))
        return found


def sampled_corpus(llm: LLM, cases: Sequence[Case], max_tokens: int) -> CorpusResult:
    params = [schema_params(c, 1.0, seed, max_tokens) for seed, c in enumerate(cases, start=1)]
    return CorpusResult(1.0, list(cases), llm.chat([messages(c) for c in cases], params, use_tqdm=False))


def print_corpus(results: list[CorpusResult], refused: dict[str, str], max_tokens: int) -> None:
    print(f"\n## 1. Schema corpus (max_tokens {max_tokens}; temperature 1 seeded per request)\n")
    print("| temperature | schemas | refused | finished with stop | valid of those | hit max_tokens | other |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        stop, length = len(r.finished("stop")), len(r.finished("length"))
        valid = stop - len(r.invalid())
        other = len(r.outputs) - stop - length
        share = f"{valid}/{stop} ({valid / max(1, stop):.0%})"
        total = len(r.cases) + len(refused)
        print(
            f"| {r.temperature:g} | {total} | {len(refused)} | {stop} | {share} | {length} "
            f"({length / max(1, len(r.outputs)):.0%}) | {other} |"
        )
    all_valid = all(not r.invalid() for r in results)
    print(f"\nvalid outputs of those that finished with stop: {'100%: ok' if all_valid else 'MISSED (below)'}")
    for r in results:
        hit = [r.cases[i].name for i in r.finished("length")]
        print(f"- temperature {r.temperature:g}, hit max_tokens: {', '.join(hit) or 'none'}")
        for name, error, text in r.invalid():
            print(f"- temperature {r.temperature:g}, INVALID {name}: {error}; output {text[:200]!r}")
    for name, reason in refused.items():
        print(f"- refused {name}: {reason}")


# ---- part 2: the cost of masking -----------------------------------------------------------------------


def spread(cases: Sequence[Case], count: int) -> list[Case]:
    """`count` cases spread evenly over the corpus (going round it again when it is shorter)."""
    if count > len(cases):
        return [cases[i % len(cases)] for i in range(count)]
    return [cases[i * len(cases) // count] for i in range(count)]


def overhead(llm: SnapshotLLM, cases: Sequence[Case], max_tokens: int, repeats: int = 3) -> None:
    warm(llm, cases)
    constrained_params = [schema_params(c, 0.0, 0, max_tokens) for c in cases]
    constrained: list[Run] = []
    plain: list[Run] = []
    mask_seconds = wait_seconds = 0.0
    plain_params: list[SamplingParams] = []
    for _ in range(repeats):
        before = llm.snapshot
        constrained.append(timed_chat(llm, cases, constrained_params))
        mask_seconds += llm.snapshot.grammar_mask_seconds - before.grammar_mask_seconds
        wait_seconds += llm.snapshot.grammar_mask_wait_seconds - before.grammar_mask_wait_seconds
        if not plain_params:
            lengths = [len(ids) for ids in constrained[0].token_ids]
            plain_params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in lengths]
        plain.append(timed_chat(llm, cases, plain_params))
    print_overhead(constrained, plain, mask_seconds, wait_seconds)


def print_overhead(constrained: list[Run], plain: list[Run], mask_seconds: float, wait_seconds: float) -> None:
    best_a = min(constrained, key=lambda r: r.seconds)
    best_b = min(plain, key=lambda r: r.seconds)
    same = all(r.token_ids == constrained[0].token_ids for r in constrained)
    requests = len(best_a.outputs)
    print(f"\n## 2. Overhead: {requests} concurrent JSON-schema requests, greedy, jump-forward off\n")
    print(f"| run | requests | output tokens | engine steps | {repeats_header(constrained)} | output tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, runs, best in (("constrained", constrained, best_a), ("unconstrained, same lengths", plain, best_b)):
        times = ", ".join(f"{r.seconds:.1f}" for r in runs)
        print(
            f"| {name} | {requests} | {best.num_tokens} | {best.steps} | {best.seconds:.2f} | {times} | "
            f"{best.tokens_per_second:.1f} |"
        )
    ratio = best_a.tokens_per_second / best_b.tokens_per_second
    verdict = "met" if ratio >= OVERHEAD_TARGET else "MISSED"
    print(f"\nconstrained / unconstrained: {ratio:.3f}x (target >= {OVERHEAD_TARGET:.2f}x: {verdict})")
    print(f"constrained outputs identical in all runs: {'yes' if same else 'NO'}")
    tokens = sum(r.num_tokens for r in constrained)
    seconds = sum(r.seconds for r in constrained)
    print(
        f"mask filling (worker thread, during the forward): {mask_seconds / tokens * 1e6:.0f} us per token; "
        f"steps waiting for masks after their forward: {wait_seconds:.2f} s of {seconds:.1f} s "
        f"({wait_seconds / seconds:.1%})"
    )


# ---- part 3: jump-forward -----------------------------------------------------------------------------


def jump_forward(
    fast_llm: SnapshotLLM, slow_llm: SnapshotLLM, cases: Sequence[Case], max_tokens: int, repeats: int = 3
) -> tuple[list[Run], list[Run], int]:
    """Greedy runs of the corpus alternately without and with jump-forward; the tokens it appended per run."""
    params = [schema_params(c, 0.0, 0, max_tokens) for c in cases]
    warm(slow_llm, cases)
    warm(fast_llm, cases)
    before = fast_llm.snapshot.jump_forward_tokens
    slow: list[Run] = []
    fast: list[Run] = []
    for _ in range(repeats):
        slow.append(timed_chat(slow_llm, cases, params))
        fast.append(timed_chat(fast_llm, cases, params))
    return fast, slow, (fast_llm.snapshot.jump_forward_tokens - before) // repeats


def print_jump_forward(fast: list[Run], slow: list[Run], jumped: int) -> None:
    reference = slow[0].token_ids
    equal = sum(all(run.token_ids[i] == ids for run in fast + slow) for i, ids in enumerate(reference))
    best_fast = min(fast, key=lambda r: r.seconds)
    best_slow = min(slow, key=lambda r: r.seconds)
    print(f"\n## 3. Jump-forward: the corpus at temperature 0, {len(reference)} requests in one batch\n")
    print(
        f"| jump-forward | requests | output tokens | engine steps | {repeats_header(fast)} | output tok/s | "
        "mean request latency (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, runs, best in (("off", slow, best_slow), ("on", fast, best_fast)):
        times = ", ".join(f"{r.seconds:.1f}" for r in runs)
        print(
            f"| {name} | {len(best.outputs)} | {best.num_tokens} | {best.steps} | {best.seconds:.2f} | {times} | "
            f"{best.tokens_per_second:.1f} | {best.mean_latency:.2f} |"
        )
    verdict = "ok" if equal == len(reference) else "MISSED"
    print(f"\noutputs with equal token ids (on and off, every run): {equal}/{len(reference)} ({verdict})")
    print(
        f"speed-up: {best_fast.tokens_per_second / best_slow.tokens_per_second:.2f}x tokens/s, "
        f"{best_slow.steps / max(1, best_fast.steps):.2f}x fewer steps, "
        f"{best_slow.mean_latency / max(1e-9, best_fast.mean_latency):.2f}x lower mean request latency; "
        f"tokens appended by jump-forward: {jumped} ({jumped / max(1, best_fast.num_tokens):.0%} of output tokens)"
    )
    capped = sum(o.outputs[0].finish_reason == "length" for o in best_fast.outputs)
    if capped:
        print(
            f"(a batch takes as many steps as its longest request: the {capped} requests that run to max_tokens "
            "bound the steps and the wall clock, whatever jump-forward saves the others)"
        )


# ---- the whole run ------------------------------------------------------------------------------------


def cpu_model() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    isa = "AVX-512" if " avx512f" in info else "AVX2" if " avx2" in info else "no AVX2"
    return f"{names[0] if names else 'unknown CPU'} ({isa})"


def print_header(num_threads: int) -> None:
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("llguidance", "jsonschema"))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print("# Structured output\n")
    print(f"- machine: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f} at the start")
    print(f"- date: {now}")
    print(f"- torch {torch.__version__} ({num_threads} threads), {versions}")
    print("- model: the embedded SmolLM2-135M-Instruct, float32; JSON written with json.dumps's separators")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrent", type=int, default=32, help="requests of the overhead part")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="8 schemas, 8 concurrent requests")
    args = parser.parse_args()
    corpus = CORPUS[:: len(CORPUS) // 8][:8] if args.quick else CORPUS
    concurrent = 8 if args.quick else args.concurrent
    print_header(args.threads)

    fast_llm = SnapshotLLM(num_threads=args.threads)
    slow_llm = SnapshotLLM(num_threads=args.threads, jump_forward=False)  # idle while the other runs
    try:
        refused = refusals(fast_llm, corpus)
        cases = [c for c in corpus if c.name not in refused]
        fast, slow, jumped = jump_forward(fast_llm, slow_llm, cases, args.max_tokens)
        results = [CorpusResult(0.0, cases, fast[0].outputs), sampled_corpus(fast_llm, cases, args.max_tokens)]
        print_corpus(results, refused, args.max_tokens)
        overhead(slow_llm, spread(cases, concurrent), args.max_tokens)
        print_jump_forward(fast, slow, jumped)
    finally:
        fast_llm.close()
        slow_llm.close()


if __name__ == "__main__":
    main()
