"""One streamed request to an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagedserve.server.benchmark.config import BenchmarkConfig
from pagedserve.server.benchmark.workloads import SampleRequest

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# No read limit short of this: a request may wait long in a deep server queue before its first byte.
TIMEOUT = httpx.Timeout(1800.0, connect=30.0)
MAX_ERROR_CHARS = 300


@dataclass
class RequestRecord:
    """What the client saw of one request; times are time.perf_counter() seconds."""

    send_time: float = 0.0
    finish_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk that carried text
    generated_text: str = ""
    prompt_tokens: int = 0  # the usage chunk's count, else the workload's (without chat template)
    output_tokens: int | None = None  # the usage chunk's count; None until counted from the text
    success: bool = False
    status: int | None = None  # HTTP status; None when no response came
    retry_after: str | None = None  # the Retry-After header of a refused request
    timed_out: bool = False  # an httpx timeout, before the answer or while reading it
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def e2e(self) -> float:
        return self.finish_time - self.send_time


def request_body(config: BenchmarkConfig, model: str, request: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True  # not OpenAI's: every request then generates exactly max_tokens
    if config.endpoint_type == "chat":
        system = [{"role": "system", "content": request.system}] if request.system is not None else []
        body["messages"] = [*system, {"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt if request.system is None else f"{request.system}\n\n{request.prompt}"
    return body


async def send_request(
    client: httpx.AsyncClient, config: BenchmarkConfig, model: str, request: SampleRequest
) -> RequestRecord:
    """Streams one request; failures are recorded, never raised."""
    record = RequestRecord(prompt_tokens=request.prompt_len)
    body = request_body(config, model, request)
    record.send_time = time.perf_counter()
    try:
        async with client.stream("POST", PATHS[config.endpoint_type], json=body) as response:
            record.status = response.status_code
            record.retry_after = response.headers.get("retry-after")
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {error_message((await response.aread()).decode())}"
            else:
                await read_stream(response, config.endpoint_type, record)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.success, record.error = False, f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        record.timed_out = isinstance(exc, httpx.TimeoutException)
    record.finish_time = time.perf_counter()
    return record


async def read_stream(response: httpx.Response, endpoint_type: str, record: RequestRecord) -> None:
    parts = []
    async for line in response.aiter_lines():
        now = time.perf_counter()
        data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
        if not data:
            continue  # blank separators, comments, keep-alives
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("error"):  # a failure after the stream started: the status is already 200
            record.error = error_message(data)
            return
        text = chunk_text(chunk, endpoint_type)
        if text:
            record.chunk_times.append(now)
            parts.append(text)
        if usage := chunk.get("usage"):
            record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
            record.output_tokens = usage.get("completion_tokens")
    record.generated_text = "".join(parts)
    record.success = bool(record.chunk_times)  # no text: no time to first token to report
    if not record.success:
        record.error = "the stream carried no text"


def chunk_text(chunk: dict[str, Any], endpoint_type: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint_type == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def error_message(body: str) -> str:
    """The OpenAI error object's message when the body has one, else the body itself."""
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (json.JSONDecodeError, AttributeError):
        message = None
    return str(message or body.strip() or "(empty body)")[:MAX_ERROR_CHARS]


async def first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{client.base_url}/v1/models lists no model: pass --model")
    return str(models[0]["id"])
