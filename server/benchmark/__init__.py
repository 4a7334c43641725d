"""`pagedserve bench serve`: a load generator for any OpenAI-compatible endpoint, with vLLM-style metrics.

from pagedserve.server.benchmark import BenchmarkConfig, run_benchmark
result = run_benchmark(BenchmarkConfig(base_url="http://127.0.0.1:8000", num_prompts=200, request_rate=8))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.server.benchmark.config import BenchmarkConfig
    from pagedserve.server.benchmark.report import format_table
    from pagedserve.server.benchmark.runner import run_benchmark, run_benchmark_async

# The names load on first use: the CLI reaches this package for `pagedserve bench`'s flags, and `pagedserve serve`
# should not pay for the runner's imports (httpx, numpy, tqdm).
_HOMES = {
    "BenchmarkConfig": "pagedserve.server.benchmark.config",
    "format_table": "pagedserve.server.benchmark.report",
    "run_benchmark": "pagedserve.server.benchmark.runner",
    "run_benchmark_async": "pagedserve.server.benchmark.runner",
}

__all__ = ["BenchmarkConfig", "format_table", "run_benchmark", "run_benchmark_async"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
