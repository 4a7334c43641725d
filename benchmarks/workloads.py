"""Seeded prompt workloads shared by the benchmarks (no data set download needed)."""

from __future__ import annotations

import random

WORDS = (  # noqa: SIM905 (a word list reads better as one string)
    "the of and to in is was for on that with as by at from his her an were are which this be or has had not "
    "but what all when there can more if out so up said about other into than its time only could new some "
    "these two may first then do any like my now over such our man me even most made after also did many "
    "before must through back years where much your way well down should because each just those people how "
    "too little state good very make world still own see men work long get here between both life being under "
    "never day same another know while last might us great old year off come since against go came right used "
    "take three river garden window engine market letter morning station silver winter harbour mountain"
).split()


def filler_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def chat_prompts(tokenizer, count: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """Chat-templated prompts whose token counts are uniform in [min_tokens, max_tokens] (above the template)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        target = rng.randint(min_tokens, max_tokens)
        body_ids = tokenizer.encode(filler_text(rng, max_tokens), add_special_tokens=False)
        overhead = len(_templated(tokenizer, ""))
        body = tokenizer.decode(body_ids[: max(1, target - overhead)])
        prompts.append(_templated(tokenizer, "Continue this text: " + body))
    return prompts


def _templated(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


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
