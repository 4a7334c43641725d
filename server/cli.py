"""The `pagedserve` command: `serve` (OpenAI-compatible HTTP server), `generate` and `chat` (offline), `bench`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from pagedserve.engine.core.process import connect_core
from pagedserve.server import offline
from pagedserve.server.benchmark.command import add_bench_commands
from pagedserve.server.engine_args import add_engine_args, engine_config
from pagedserve.server.logs import LOG_FORMATS, configure_logging
from pagedserve.server.offline import LOG_LEVELS
from pagedserve.server.reasoning import THINK_PARSERS
from pagedserve.server.settings import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    add_listen_args,
    positive,
)
from pagedserve.server.tool_parsers import AUTO_TOOL_PARSERS

API_KEY_ENV = "PAGEDSERVE_API_KEY"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)

    def print_help(_: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(run=print_help, log_level="warning", log_format="text")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_serve(commands)
    offline.add_commands(commands)
    _add_bench(commands)
    return parser


def _add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmark a running server", description="Benchmark a running server.")
    add_bench_commands(bench)


def _add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API; /ready turns 200 once it has loaded.",
    )
    serve.add_argument("model_path", nargs="?", metavar="MODEL", help="same as --model")
    http = serve.add_argument_group("http")
    add_listen_args(http)
    http.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="names clients may use; the first is reported (default: the engine's served_model_name, else the model)",
    )
    http.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require this bearer key; the process list shows it: prefer the variable {API_KEY_ENV}",
    )
    http.add_argument("--cors-allowed-origins", nargs="*", default=[], metavar="ORIGIN", help="(default: none)")
    http.add_argument(
        "--root-path",
        default="",
        metavar="PREFIX",
        help="the path prefix under which a proxy serves this server, e.g. /llm (the proxy strips it; default: none)",
    )
    http.add_argument(
        "--disable-web-page",
        action="store_true",
        help="no chat and status page at / (default: served, with the API key asked for when there is one)",
    )
    http.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="(default: info)")
    http.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="json: one object per line, a request-log line per request and uvicorn's access log too (default: text)",
    )
    http.add_argument(
        "--max-request-bytes", type=positive(int), default=1 << 20, help="larger bodies get 413 (default: 1 MiB)"
    )
    http.add_argument(
        "--header-timeout",
        type=positive(float),
        default=DEFAULT_HEADER_TIMEOUT,
        metavar="SECONDS",
        help="close a connection whose request headers are not complete this long after it opened or after its "
        "previous answer: slow or idle clients cannot hold connections (default: %(default)g)",
    )
    http.add_argument(
        "--body-timeout",
        type=positive(float),
        default=DEFAULT_BODY_TIMEOUT,
        metavar="SECONDS",
        help="answer 408 and close a connection whose request body is not complete this long after its headers: "
        "announced bodies that never come cannot hold queue places (default: %(default)g)",
    )
    http.add_argument(
        "--max-connections",
        type=positive(int),
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="open connections, idle ones included; more are answered 503 and closed (default: %(default)s)",
    )
    chat = serve.add_argument_group("chat replies")
    chat.add_argument(
        "--tool-call-parser",
        choices=("auto", *AUTO_TOOL_PARSERS),
        default="auto",
        help="how tool calls are read from replies under tool_choice auto; auto: from the chat template (default)",
    )
    chat.add_argument(
        "--reasoning-parser",
        choices=("auto", *THINK_PARSERS, "none"),
        default="auto",
        help="think (qwen3, deepseek_r1: the same): a reply's leading <think>...</think> becomes reasoning_content; "
        "auto: when the chat template mentions <think> (default)",
    )
    add_engine_args(serve, exclude=frozenset({"served_model_name"}))
    serve.set_defaults(run=serve_command)


def serve_command(args: argparse.Namespace) -> NoReturn:
    config = engine_config(args, model=args.model_path)
    core = connect_core(config)
    core.start(heartbeats=True)  # the core imports torch and loads the model while this process imports the server
    from pagedserve.server.serve import run_server  # here, after the start: seconds of imports, overlapped

    run_server(args, config, core)


if __name__ == "__main__":
    sys.exit(main())
