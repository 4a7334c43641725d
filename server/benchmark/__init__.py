"""`pagedserve bench serve`: a load generator for any OpenAI-compatible endpoint, with vLLM-style metrics.

from pagedserve.server.benchmark import BenchmarkConfig, run_benchmark
result = run_benchmark(BenchmarkConfig(base_url="http://127.0.0.1:8000", num_prompts=200, request_rate=8))
"""

from __future__ import annotations

from pagedserve.server.benchmark.config import BenchmarkConfig
from pagedserve.server.benchmark.report import format_table
from pagedserve.server.benchmark.runner import run_benchmark, run_benchmark_async

__all__ = ["BenchmarkConfig", "format_table", "run_benchmark", "run_benchmark_async"]
