"""The OpenAI API suite of test_server.py, a subset of it, against the embedded model split over three ranks.

SmolLM2's 9 heads and 3 KV heads split over 3 ranks only (besides 1). The test functions are test_server.py's own;
the fixtures here put them in front of an engine whose model is split (gloo, one rank per process).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedserve.engine import EngineConfig
from pagedserve.engine.client.async_engine import AsyncEngine
from tests.test_server import (  # noqa: F401  (collected here; url and client stand on this module's engine)
    client,
    test_chat_completion,
    test_chat_logprobs,
    test_chat_stream_with_usage,
    test_completions_forms_echo_and_logprobs,
    test_completions_stream,
    test_n_choices,
    test_n_choices_stream_each_on_its_own_index,
    test_seed_reproduces_sampling,
    test_stop_string,
    url,
)

pytestmark = pytest.mark.slow  # three ranks on a 2-core machine: each step pays the all-reduces


@pytest.fixture(scope="module")
def engine(smol_dir: Path) -> Iterator[AsyncEngine]:
    config = EngineConfig(
        model=str(smol_dir), num_kv_blocks=128, max_num_seqs=16, tensor_parallel_size=3, num_threads=1
    )
    engine = AsyncEngine.from_config(config).start()
    try:
        assert engine.wait_ready(300), engine.unavailable_reason()
        yield engine
    finally:
        engine.shutdown()


def test_the_model_is_split_over_three_ranks(url: str) -> None:  # noqa: F811 (the fixture imported above)
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'pagedserve:tensor_parallel_size{model_name="smol"} 3.0' in metrics
