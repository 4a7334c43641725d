"""`pagedserve bench serve`: a load generator for any OpenAI-compatible endpoint, with vLLM-style metrics.

from server.benchmark import BenchmarkConfig, run_benchmark
result = run_benchmark(BenchmarkConfig(base_url="http://127.0.0.1:8000", num_prompts=200, request_rate=8))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from server.benchmark.config import BenchmarkConfig
from server.benchmark.report import format_table

if TYPE_CHECKING:
    from server.benchmark.runner import run_benchmark, run_benchmark_async

__all__ = ["BenchmarkConfig", "format_table", "run_benchmark", "run_benchmark_async"]
_RUNNER = ("run_benchmark", "run_benchmark_async")


def __getattr__(name: str) -> Any:
    # The runner needs httpx, which the server itself does not: `pagedserve serve` imports this package via its
    # CLI, so the runner loads on first use only.
    if name in _RUNNER:
        return getattr(importlib.import_module("server.benchmark.runner"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
