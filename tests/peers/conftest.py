"""Fixtures for the peers' suites: one server per module in front of the embedded SmolLM2, and clients for it.

These tests are ours, written from what vLLM's `tests/entrypoints/openai` and llama.cpp's
`tools/server/tests/unit` check, pointed at pagedserve. Answers those suites pin to their own models (exact
texts, prompt token counts of their tokenizers) are checked here against transformers or left out; the README's
test section lists them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pagedserve.engine import EngineConfig
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings
from tests.servers import served_engine

MODEL = "smol"


@pytest.fixture(scope="module")
def url(smol_loaded: LoadedModel) -> Iterator[str]:
    config = EngineConfig(num_kv_blocks=256, max_num_seqs=8)
    with served_engine(config, smol_loaded, ServerSettings([MODEL])) as url:
        yield url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def post(url: str, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)
