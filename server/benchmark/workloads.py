"""Seeded request workloads, with prompt lengths measured in tokens of the served model's tokenizer.

Every prompt starts with a short random word sequence drawn from the seed and a per-run nonce, so a
server never gets prefix-cache hits from an earlier run; the shared-prefix workload shares its system
prompt between the requests of one run on purpose.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pagedserve.server.benchmark.config import BenchmarkConfig

WORDS = (  # noqa: SIM905 (a word list reads better as one string)
    "the of and to in is was for on that with as by at from his her an were are which this be or has had not "
    "but what all when there can more if out so up said about other into than its time only could new some "
    "these two may first then do any like my now over such our man me even most made after also did many "
    "before must through back years where much your way well down should because each just those people how "
    "too little state good very make world still own see men work long get here between both life being under "
    "never day same another know while last might us great old year off come since against go came right used "
    "take three river garden window engine market letter morning station silver winter harbour mountain"
).split()
PREFIX_WORDS = 8  # about 200**8 sequences: two requests never share their first block
MIN_TOKENS = 4  # ShareGPT requests shorter than this say nothing about serving


class Tokenizer(Protocol):
    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    prompt: str  # the user message (chat) or the text after the system prompt (completions)
    prompt_len: int  # tokens of system + prompt, without any chat template
    output_len: int  # max_tokens
    system: str | None = None  # shared-prefix: the system prompt all requests of the run share


def filler_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def sharegpt_like_lengths(count: int, max_model_len: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, output) token counts from long-tailed log-normal laws shaped like ShareGPT's.

    ShareGPT conversations have median prompts near 100 tokens and outputs near 200, with tails into the
    thousands; each pair is clipped so that it fits max_model_len.
    """
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        prompt = max(4, min(int(rng.lognormvariate(4.6, 1.0)), max_model_len // 2))
        output = max(4, min(int(rng.lognormvariate(5.2, 0.9)), max_model_len - prompt))
        pairs.append((prompt, output))
    return pairs


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def text_of_length(tokenizer: Tokenizer, rng: random.Random, num_tokens: int, head: str = "") -> str:
    """`head` then filler words, cut to num_tokens tokens (re-encoding the cut text may differ by a token)."""
    words = f"{head} {filler_text(rng, num_tokens)}".strip()  # a word is at least one token: enough of them
    return tokenizer.decode(tokenizer.encode(words, add_special_tokens=False)[:num_tokens])


def build_requests(config: BenchmarkConfig, tokenizer: Tokenizer, nonce: str) -> list[SampleRequest]:
    """config.num_prompts requests; the same seed and nonce give the same requests."""
    body_rng = random.Random(config.seed)
    prefixes = prefix_generator(config.seed, nonce)
    if config.dataset_path is not None:
        return sharegpt_file_requests(config, tokenizer, prefixes)
    if config.workload == "shared-prefix":
        return shared_prefix_requests(config, tokenizer, body_rng, prefixes)
    if config.workload == "sharegpt-like":
        lengths = sharegpt_like_lengths(config.num_prompts, config.max_model_len, config.seed)
    else:
        lengths = [(config.input_len, config.output_len)] * config.num_prompts
    return [synthetic_request(tokenizer, body_rng, next(prefixes), p, o) for p, o in lengths]


def prefix_generator(seed: int, nonce: str) -> Iterator[str]:
    """Endless distinct-per-run word sequences (a str seed hashes the same in every process)."""
    rng = random.Random(f"{seed}:{nonce}")
    while True:
        yield filler_text(rng, PREFIX_WORDS)


def synthetic_request(
    tokenizer: Tokenizer, rng: random.Random, prefix: str, prompt_len: int, output_len: int
) -> SampleRequest:
    prompt = text_of_length(tokenizer, rng, prompt_len, head=prefix)
    return SampleRequest(prompt, count_tokens(tokenizer, prompt), output_len)


def shared_prefix_requests(
    config: BenchmarkConfig, tokenizer: Tokenizer, rng: random.Random, prefixes: Iterator[str]
) -> list[SampleRequest]:
    # The system prompt takes the run's first random prefix too: shared within the run, new in the next.
    system = text_of_length(tokenizer, rng, config.prefix_len, head=next(prefixes))
    system_len = count_tokens(tokenizer, system)
    requests = []
    for _ in range(config.num_prompts):
        prompt = text_of_length(tokenizer, rng, config.input_len, head=next(prefixes))
        requests.append(SampleRequest(prompt, system_len + count_tokens(tokenizer, prompt), config.output_len, system))
    return requests


def sharegpt_file_requests(
    config: BenchmarkConfig, tokenizer: Tokenizer, prefixes: Iterator[str]
) -> list[SampleRequest]:
    """First human turn as the prompt, the reply's token count as max_tokens; shuffled by the seed."""
    pairs = sharegpt_pairs(json.loads(Path(config.dataset_path or "").read_text()))
    random.Random(config.seed).shuffle(pairs)
    requests = []
    for human, reply in pairs:  # tokenize lazily: the full data set has ~90k conversations
        prompt = f"{next(prefixes)} {human}"
        prompt_len, output_len = count_tokens(tokenizer, prompt), count_tokens(tokenizer, reply)
        if min(prompt_len, output_len) >= MIN_TOKENS and prompt_len + output_len <= config.max_model_len:
            requests.append(SampleRequest(prompt, prompt_len, output_len))
            if len(requests) == config.num_prompts:
                return requests
    raise ValueError(
        f"{config.dataset_path} has {len(requests)} usable conversations, fewer than the {config.num_prompts} asked"
    )


def sharegpt_pairs(conversations: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(first human turn, the gpt reply after it) of each conversation that has both."""
    pairs = []
    for item in conversations:
        turns = item.get("conversations") or []
        first = next((i for i, turn in enumerate(turns) if turn.get("from") == "human"), None)
        if first is not None and first + 1 < len(turns) and turns[first + 1].get("from") == "gpt":
            pairs.append((turns[first]["value"], turns[first + 1]["value"]))
    return pairs
