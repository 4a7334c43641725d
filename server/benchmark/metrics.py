"""vLLM-style serving metrics from the client's request records."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pagedserve.server.benchmark.client import RequestRecord

MAX_ERROR_EXAMPLES = 5


def distribution_ms(seconds: Sequence[float]) -> dict[str, float]:
    """mean, median, p90, p99 in milliseconds (linear interpolation); zeros when there is nothing to measure."""
    if not seconds:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    values = np.asarray(seconds, dtype=float) * 1000.0
    median, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(values.mean()), "median": float(median), "p90": float(p90), "p99": float(p99)}


def tpot(record: RequestRecord) -> float:
    """Time per output token after the first; 0 for a single-token reply (it has none)."""
    tokens = record.output_tokens or 0
    return (record.e2e - record.ttft) / (tokens - 1) if tokens > 1 else 0.0


def inter_token_latencies(record: RequestRecord) -> list[float]:
    return [later - earlier for earlier, later in itertools.pairwise(record.chunk_times)]


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """The most requests in flight at once, failures included (they held a connection too)."""
    events = [(r.send_time, 1) for r in records] + [(r.finish_time, -1) for r in records]
    events.sort()  # at equal times -1 sorts first: a request that ends as another starts does not overlap it
    in_flight = peak = 0
    for _, change in events:
        in_flight += change
        peak = max(peak, in_flight)
    return peak


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    measured = {"ttft": record.ttft, "tpot": tpot(record), "e2e": record.e2e}
    return all(measured[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slos_ms: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """The result's metric keys; throughputs count completed requests only."""
    done = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens or 0 for r in done)
    goodput = None
    if slos_ms:
        goodput = sum(meets_slos(r, slos_ms) for r in done) / duration_s
    return {
        "completed": len(done),
        "failed": len(records) - len(done),  # rejected_503 included
        "rejected_503": sum(r.status == 503 for r in records),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": distribution_ms([r.ttft for r in done]),
        "tpot_ms": distribution_ms([tpot(r) for r in done if (r.output_tokens or 0) > 1]),
        "itl_ms": distribution_ms([gap for r in done for gap in inter_token_latencies(r)]),
        "e2e_ms": distribution_ms([r.e2e for r in done]),
        "peak_concurrency": peak_concurrency(records),
        "goodput": goodput,
        **shedding(records),
        "errors": error_examples(records),
    }


def shedding(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """How an overloaded server turned requests away: refusals (503), and waits that ran out instead."""
    refused = [r for r in records if r.status == 503]
    first_sent = min((r.send_time for r in records), default=0.0)
    return {
        "rejected_with_retry_after": sum(r.retry_after is not None for r in refused),
        "timeouts": sum(r.timed_out or r.status in (408, 504) for r in records),  # the client's or the server's
        "first_rejection_ms": (min(r.finish_time for r in refused) - first_sent) * 1000.0 if refused else None,
        "rejection_ms": distribution_ms([r.e2e for r in refused]),  # sent to refused, per request
    }


def error_examples(records: Sequence[RequestRecord]) -> list[str]:
    distinct = dict.fromkeys(r.error for r in records if not r.success and r.error)
    return list(distinct)[:MAX_ERROR_EXAMPLES]
