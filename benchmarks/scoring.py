"""Scoring through the server: its accuracy against transformers, and what a long scoring request costs.

1. Accuracy, as lm-evaluation-harness's `local-completions` model scores: for each (context, continuation) pair
   it asks /v1/completions for `echo=true, logprobs=1, max_tokens=0` on the token ids of context + continuation,
   sums the continuation tokens' logprobs (the loglikelihood) and checks whether each was the greedy choice, then
   computes the same with transformers on the same model in float32.
2. Cost (benchmarks/scoring_cost.py): a ~3,000-token prompt with `max_tokens: 1` with and without
   `prompt_logprobs: 20` (and echo + logprobs 20), each beside a streaming request whose longest wait between
   chunks it reports (targets: scoring within 2x of the same prefill, no wait longer than one full step).

    python -m benchmarks.scoring [--pairs 64] [--prompt-tokens 3000] [--rounds 2] [--skip-accuracy] [--skip-cost]
        [engine flags]
"""

from __future__ import annotations

import argparse
import random
import time

import httpx
import torch
import transformers

from benchmarks.scoring_cost import print_cost, scoring_cost
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.server import ServerSettings, create_app
from pagedserve.server.engine_args import add_engine_args, engine_config
from tests.background import BackgroundServer

MODEL = "scoring"
TOLERANCE = 1e-3  # per sequence, in nats
CONTEXTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The first person to walk on the moon was",
    "In Python, a list can be sorted with the",
    "The largest planet in the solar system is",
    "A group of lions is called a",
    "The chemical symbol for gold is",
    "Shakespeare wrote the play",
]
CONTINUATIONS = [" Paris.", " 100 degrees Celsius.", " Neil Armstrong.", " sorted() function.", " Jupiter.", " pride."]


def pairs(count: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(rng.choice(CONTEXTS) * rng.randint(1, 12), rng.choice(CONTINUATIONS)) for _ in range(count)]


def server_scores(url: str, tokens: list[tuple[list[int], list[int]]]) -> tuple[list[tuple[float, bool]], float]:
    """(loglikelihood, greedy) per pair, and the seconds the requests took, one at a time."""
    results: list[tuple[float, bool]] = []
    start = time.perf_counter()
    with httpx.Client(base_url=url, timeout=300) as client:
        for context, continuation in tokens:
            body = {"model": MODEL, "prompt": context + continuation, "echo": True, "logprobs": 1, "max_tokens": 0}
            logprobs = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
            tail = slice(len(context), None)
            chosen = logprobs["token_logprobs"][tail]
            best = [max(top.values()) for top in logprobs["top_logprobs"][tail]]
            results.append((sum(chosen), all(c >= b for c, b in zip(chosen, best))))
    return results, time.perf_counter() - start


def reference_scores(
    model_dir: str, tokens: list[tuple[list[int], list[int]]]
) -> tuple[list[tuple[float, bool]], float]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    start = time.perf_counter()
    with torch.no_grad():
        for context, continuation in tokens:
            ids = torch.tensor([context + continuation])
            logprobs = torch.log_softmax(model(ids).logits[0, len(context) - 1 : -1].float(), dim=-1)
            targets = torch.tensor(continuation)
            chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
            results.append((float(chosen.sum()), bool((logprobs.argmax(-1) == targets).all())))
    return results, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=3000, help="the long prompt of the cost figures")
    parser.add_argument("--rounds", type=int, default=2, help="the cost figures' best of this many rounds")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-cost", action="store_true")
    add_engine_args(parser)
    args = parser.parse_args()
    engine = AsyncEngine.from_config(engine_config(args)).start()
    if not engine.wait_ready():
        raise SystemExit(f"the engine failed to load: {engine.unavailable_reason()}")
    tokenizer = engine.tokenizer.tokenizer
    tokens = [(tokenizer.encode(c), tokenizer.encode(x, add_special_tokens=False)) for c, x in pairs(args.pairs)]
    try:
        with BackgroundServer(create_app(engine, ServerSettings([MODEL]))) as server:
            ours, our_seconds = ([], 0.0) if args.skip_accuracy else server_scores(server.url, tokens)
            cost = (
                None if args.skip_cost else scoring_cost(server.url, MODEL, tokenizer, args.prompt_tokens, args.rounds)
            )
    finally:
        engine.shutdown()
    if not args.skip_accuracy:
        print_accuracy(engine.info.model_dir, tokens, ours, our_seconds)
    if cost is not None:
        print_cost(cost, args.prompt_tokens)


def print_accuracy(
    model_dir: str, tokens: list[tuple[list[int], list[int]]], ours: list[tuple[float, bool]], our_seconds: float
) -> None:
    theirs, their_seconds = reference_scores(model_dir, tokens)
    differences = [abs(a[0] - b[0]) for a, b in zip(ours, theirs)]
    greedy_agree = sum(a[1] == b[1] for a, b in zip(ours, theirs))
    num_tokens = sum(len(c) + len(x) for c, x in tokens)
    print(
        f"{len(tokens)} pairs, {num_tokens} tokens (contexts of {min(len(c) for c, _ in tokens)}-"
        f"{max(len(c) for c, _ in tokens)} tokens)"
    )
    print(
        f"loglikelihood |pagedserve - transformers|: max {max(differences):.2e}, mean "
        f"{sum(differences) / len(differences):.2e} nats (tolerance {TOLERANCE:g}: "
        f"{'ok' if max(differences) < TOLERANCE else 'MISSED'})"
    )
    print(f"is-greedy agrees on {greedy_agree}/{len(tokens)}")
    print(f"seconds: pagedserve over HTTP {our_seconds:.1f} (one request at a time), transformers {their_seconds:.1f}")


if __name__ == "__main__":
    main()
