"""The result as a table for the terminal."""

from __future__ import annotations

from typing import Any

WIDTH = 52
LATENCIES = {
    "ttft_ms": "Time to first token",
    "tpot_ms": "Time per output token (after the first)",
    "itl_ms": "Inter-token latency (between chunks)",
    "e2e_ms": "End-to-end latency",
}


def format_table(result: dict[str, Any]) -> str:
    config = result["config"]
    rows = [
        _title("Serving Benchmark Result"),
        _row("Model", result["model"]),
        _row("Endpoint / workload", f"{config['endpoint_type']} / {config['workload']}"),
        _row("Request rate (req/s)", config["request_rate"]),
        _row("Max concurrency", config["max_concurrency"] or "unlimited"),
        _row("Successful requests", result["completed"]),
        _row("Failed requests", result["failed"]),
        _row("  of which 503 (rejected)", result["rejected_503"]),
        _row("  of which timed out", result["timeouts"]),
        _row("Peak concurrency", result["peak_concurrency"]),
        _row("Benchmark duration (s)", result["duration_s"]),
        _row("Total input tokens", result["total_input_tokens"]),
        _row("Total generated tokens", result["total_output_tokens"]),
        _row("Request throughput (req/s)", result["request_throughput"]),
        _row("Output token throughput (tok/s)", result["output_throughput"]),
        _row("Total token throughput (tok/s)", result["total_token_throughput"]),
    ]
    if result["goodput"] is not None:
        rows.append(_row("Goodput (req/s)", result["goodput"]))
        rows.append("  SLOs: " + ", ".join(f"{name} <= {limit:g} ms" for name, limit in config["goodput"].items()))
    for key, title in LATENCIES.items():
        rows.append(_title(title))
        name = key.removesuffix("_ms").upper()
        rows.extend(_row(f"{stat.capitalize()} {name} (ms)", value) for stat, value in result[key].items())
    rows.append("=" * WIDTH)
    if result["errors"]:
        rows.append("Example errors:")
        rows.extend(f"  {error}" for error in result["errors"])
    return "\n".join(rows)


def _title(text: str) -> str:
    return f" {text} ".center(WIDTH, "=" if text.endswith("Result") else "-")


def _row(name: str, value: object) -> str:
    shown = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{name + ':':<{WIDTH - 12}}{shown:>12}"
