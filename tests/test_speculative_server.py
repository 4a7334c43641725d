"""Speculative decoding through the server: 64 chat prompts, greedy, streamed by the openai SDK at 1 and 16
concurrent streams, give the same tokens as plain decoding, with n-gram proposals and with a draft model (the
target itself as its draft: every proposal is accepted)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from pagedserve.engine import EngineConfig
from pagedserve.engine.core.messages import EngineSnapshot
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings
from tests.servers import running_engine, serving

pytestmark = pytest.mark.slow  # ~1.5 minutes a method on two shared CPU cores: 64 prompts, four times

MODEL = "smol"
MAX_TOKENS = 16
TOPICS = ["the sea", "a lighthouse", "bread", "winter", "a red bicycle", "the moon", "tea", "an old clock"]
TASKS = [
    "Write one sentence about {}.",
    "Repeat exactly, nothing else: I like {} more than anything.",
    "List three words about {}.",
    "Rewrite politely: give me {} now.",
    "What rhymes with {}?",
    "Summarize in five words: {} is quiet, old and kind, and everyone in town knows it.",
    "Translate to French: {}.",
    "Say hello and mention {}.",
]
PROMPTS = [task.format(topic) for task in TASKS for topic in TOPICS]  # 64


async def stream_all(url: str, concurrency: int) -> list[list[int]]:
    """Each prompt's greedy tokens, streamed, at most `concurrency` at a time."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> list[int]:
        async with gate:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"return_token_ids": True},
            )
            tokens: list[int] = []
            async for chunk in stream:
                for choice in chunk.choices:
                    tokens += getattr(choice, "token_ids", None) or []
            return tokens

    try:
        return await asyncio.gather(*(one(p) for p in PROMPTS))
    finally:
        await client.close()


def served_tokens(
    config: EngineConfig, loaded: LoadedModel, concurrencies: list[int]
) -> tuple[list[list[list[int]]], EngineSnapshot]:
    """The tokens of every prompt at each concurrency, from one engine behind one server, and its counters."""
    with running_engine(config, loaded) as engine, serving(engine, ServerSettings([MODEL])) as url:
        runs = [asyncio.run(stream_all(url, concurrency)) for concurrency in concurrencies]
        return runs, engine.snapshot()


# speculative_token_budget: 16 streams speculate too (by default block formats on the CPU stop at two).
BASE = dict(num_kv_blocks=512, max_num_seqs=16, engine_process=False, speculative_token_budget=2048)


@pytest.fixture(scope="module")
def plain(smol_loaded: LoadedModel) -> list[list[int]]:
    config = EngineConfig(model=str(smol_loaded.model_dir), **BASE)  # type: ignore[arg-type]
    (tokens,), _ = served_tokens(config, smol_loaded, [16])
    assert all(tokens) and sum(map(len, tokens)) > len(PROMPTS) * MAX_TOKENS // 2
    return tokens


@pytest.mark.parametrize(
    "method",
    [
        dict(speculative_method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3),
        dict(speculative_method="draft", num_speculative_tokens=3),
    ],
    ids=["ngram", "draft"],
)
def test_greedy_chat_through_the_server_equals_plain_decoding(
    smol_loaded: LoadedModel, plain: list[list[int]], method: dict
) -> None:
    if method["speculative_method"] == "draft":
        method = {**method, "draft_model": str(smol_loaded.model_dir)}
    config = EngineConfig(model=str(smol_loaded.model_dir), **BASE, **method)  # type: ignore[arg-type]
    (one_stream, sixteen_streams), counters = served_tokens(config, smol_loaded, [1, 16])
    assert one_stream == plain
    assert sixteen_streams == plain
    proposed, accepted = counters.spec_decode_num_draft_tokens, counters.spec_decode_num_accepted_tokens
    assert 0 < accepted <= proposed
    if method["speculative_method"] == "draft":  # the target as its own draft agrees with itself
        assert accepted == proposed
