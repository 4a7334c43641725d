"""Seeded prompt workloads shared by the benchmarks (no data set download needed).

The generic generators live in server.benchmark.workloads, so the installed `pagedserve bench serve` has them.
"""

from __future__ import annotations

import random

from pagedserve.server.benchmark.workloads import WORDS, filler_text, sharegpt_like_lengths

__all__ = ["WORDS", "chat_prompts", "filler_text", "sharegpt_like_lengths"]


def chat_prompts(tokenizer, count: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """Chat-templated prompts whose token counts are uniform in [min_tokens, max_tokens] (above the template)."""
    rng = random.Random(seed)
    overhead = len(_templated(tokenizer, ""))
    prompts = []
    for _ in range(count):
        target = rng.randint(min_tokens, max_tokens)
        body_ids = tokenizer.encode(filler_text(rng, max_tokens), add_special_tokens=False)
        body = tokenizer.decode(body_ids[: max(1, target - overhead)])
        prompts.append(_templated(tokenizer, "Continue this text: " + body))
    return prompts


def _templated(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)
