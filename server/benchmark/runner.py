"""A whole run: resolve the model and tokenizer, build the workload, warm up, send on schedule, measure."""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import httpx
from tqdm.auto import tqdm

from pagedserve.server.benchmark.arrivals import inter_arrival_delays, paced
from pagedserve.server.benchmark.client import TIMEOUT, RequestRecord, first_model, send_request
from pagedserve.server.benchmark.config import BenchmarkConfig
from pagedserve.server.benchmark.metrics import summarize
from pagedserve.server.benchmark.workloads import (
    SampleRequest,
    Tokenizer,
    build_requests,
    count_tokens,
    synthetic_request,
)

WARMUP_MAX_TOKENS = 16


def run_benchmark(config: BenchmarkConfig) -> dict[str, Any]:
    return asyncio.run(run_benchmark_async(config))


async def run_benchmark_async(
    config: BenchmarkConfig, *, transport: httpx.AsyncBaseTransport | None = None
) -> dict[str, Any]:
    """Runs the benchmark and returns the result dict (see metrics.summarize); transport: for tests."""
    connections = (config.max_concurrency or config.num_prompts) + 1  # httpx would cap it at 100 otherwise
    async with httpx.AsyncClient(
        base_url=config.base_url,
        headers={"Authorization": f"Bearer {config.api_key}"} if config.api_key else None,
        timeout=TIMEOUT,
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        transport=transport,
    ) as client:
        model = config.model or await first_model(client)
        tokenizer_name = config.tokenizer or default_tokenizer(model)
        tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_name)
        nonce = secrets.token_hex(8)  # new prompt prefixes every run: no cache hits left by an earlier one
        requests = await asyncio.to_thread(build_requests, config, tokenizer, nonce)
        await warm_up(client, config, model, warmup_request(tokenizer, requests[0], nonce))
        records, duration_s = await send_all(client, config, model, requests)
    for record in records:
        if record.success and record.output_tokens is None:  # the server sent no usage chunk
            record.output_tokens = count_tokens(tokenizer, record.generated_text)
    result = summarize(records, duration_s, config.goodput)
    return {**result, "model": model, "tokenizer": tokenizer_name, "config": config.as_dict()}


def default_tokenizer(model: str) -> str:
    """The served model when it names a local folder, else the embedded SmolLM2 (pagedserve's default)."""
    if Path(model).exists():
        return model
    from pagedserve.engine.worker import embedded_gguf_path, gguf_model_dir  # torch: only when needed

    return str(gguf_model_dir(embedded_gguf_path()))


def load_tokenizer(name: str) -> Tokenizer:
    from transformers import AutoTokenizer

    # transformers' encode/decode accept and return more types than the protocol names
    return cast(Tokenizer, AutoTokenizer.from_pretrained(name))


def warmup_request(tokenizer: Tokenizer, first: SampleRequest, nonce: str) -> SampleRequest:
    """As long as the first request, but sharing no prefix with any timed one."""
    rng = random.Random(f"warm-up:{nonce}")
    output_len = min(first.output_len, WARMUP_MAX_TOKENS)
    return synthetic_request(tokenizer, rng, f"warm-up {nonce}", first.prompt_len, output_len)


async def warm_up(client: httpx.AsyncClient, config: BenchmarkConfig, model: str, request: SampleRequest) -> None:
    record = await send_request(client, config, model, request)
    if not record.success:
        raise RuntimeError(f"the warm-up request failed: {record.error}")


async def send_all(
    client: httpx.AsyncClient, config: BenchmarkConfig, model: str, requests: list[SampleRequest]
) -> tuple[list[RequestRecord], float]:
    """Sends every request on the arrival schedule and waits for all; returns them and the wall time."""
    delays = inter_arrival_delays(len(requests), config.request_rate, config.burstiness, config.seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    progress = tqdm(total=len(requests), disable=config.disable_tqdm, desc="requests", unit="req")

    async def one(request: SampleRequest) -> RequestRecord:
        async with slot(limit):  # waits here, past its arrival time, while max_concurrency are in flight
            record = await send_request(client, config, model, request)
        progress.update(1)
        return record

    start = time.perf_counter()
    tasks = [asyncio.create_task(one(request)) async for request in paced(requests, delays)]
    records = await asyncio.gather(*tasks)
    duration_s = time.perf_counter() - start
    progress.close()
    return records, duration_s


@contextlib.asynccontextmanager
async def slot(limit: asyncio.Semaphore | None) -> AsyncIterator[None]:
    if limit is None:
        yield
    else:
        async with limit:
            yield
