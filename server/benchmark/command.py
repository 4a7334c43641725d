"""`pagedserve bench serve` (and `python -m benchmarks.serve`): the load generator's command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from pagedserve.server.benchmark.config import ENDPOINT_TYPES, SLO_METRICS, WORKLOADS, BenchmarkConfig
from pagedserve.server.benchmark.report import format_table

DESCRIPTION = "Load-test any OpenAI-compatible server: streamed requests, TTFT/TPOT/ITL/E2E and throughput."
DEFAULT = "(default: %(default)s)"


def add_bench_commands(bench: argparse.ArgumentParser) -> None:
    """Fills the `bench` command's parser with its subcommands (today: serve)."""

    def print_help(_: argparse.Namespace) -> int:
        bench.print_help()
        return 2

    bench.set_defaults(run=print_help)
    benchmarks = bench.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    serve = benchmarks.add_parser("serve", help="load-test a running server", description=DESCRIPTION)
    add_serve_args(serve)
    serve.set_defaults(run=serve_command)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    defaults = BenchmarkConfig()
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default=defaults.base_url, help=DEFAULT)
    server.add_argument("--endpoint-type", choices=ENDPOINT_TYPES, default=defaults.endpoint_type, help=DEFAULT)
    server.add_argument("--model", help="(default: the first model GET /v1/models lists)")
    server.add_argument("--api-key", help="sent as a bearer token")
    server.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="for servers that reject it")

    workload = parser.add_argument_group("workload")
    workload.add_argument("--workload", choices=WORKLOADS, default=defaults.workload, help=DEFAULT)
    workload.add_argument("--dataset-path", help="a ShareGPT JSON file: its first questions and reply lengths")
    for flag, text in [
        ("--num-prompts", ""),
        ("--input-len", "prompt tokens"),
        ("--output-len", "max_tokens"),
        ("--prefix-len", "shared-prefix: tokens of the shared system prompt"),
        ("--max-model-len", "sharegpt: prompt + output tokens at most"),
    ]:
        default = getattr(defaults, flag[2:].replace("-", "_"))
        workload.add_argument(flag, type=_positive_int, default=default, help=f"{text} {DEFAULT}".strip())
    workload.add_argument("--tokenizer", help="counts prompt tokens (default: the model if a local path, else SmolLM2)")
    workload.add_argument("--seed", type=int, default=defaults.seed, help=DEFAULT)

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default: inf, all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson (default: 1)")
    load.add_argument("--max-concurrency", type=_positive_int, help="requests in flight at most (default: no limit)")

    output = parser.add_argument_group("output")
    output.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS", help="SLOs, e.g. ttft:500 tpot:50")
    output.add_argument("--save-result", type=Path, metavar="PATH.json", help="the result and the config as JSON")
    output.add_argument("--disable-tqdm", action="store_true")


def config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    """Every BenchmarkConfig field has a flag of the same name; only the SLOs need parsing."""
    values = {field.name: getattr(args, field.name) for field in dataclasses.fields(BenchmarkConfig)}
    return BenchmarkConfig(**{**values, "goodput": parse_slos(args.goodput)})


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not _is_positive_float(value):
            raise ValueError(f"--goodput takes METRIC:MS with METRIC one of {SLO_METRICS}, got {item!r}")
        slos[name] = float(value)
    return slos


def serve_command(args: argparse.Namespace) -> int:
    # Here, not at the top: the CLI parses every command's flags, and `pagedserve serve` needs neither httpx nor
    # numpy (~20 MiB resident in its API process).
    import httpx

    from pagedserve.server.benchmark.runner import run_benchmark

    try:
        config = config_from_args(args)
        result = run_benchmark(config)
    except httpx.TransportError as exc:  # its message does not say where it tried
        print(f"pagedserve bench serve: cannot reach {args.base_url}: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError, RuntimeError, httpx.HTTPError) as exc:
        print(f"pagedserve bench serve: {exc}", file=sys.stderr)
        return 1
    print(format_table(result))
    if args.save_result is not None:
        args.save_result.write_text(json.dumps(result, indent=2) + "\n")
        print(f"saved to {args.save_result}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=DESCRIPTION)
    add_serve_args(parser)
    return serve_command(parser.parse_args(argv))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _is_positive_float(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False
