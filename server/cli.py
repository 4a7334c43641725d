"""The `pagedserve` command: `serve` (OpenAI-compatible HTTP server), `generate` and `chat` (offline), `bench`."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

import uvicorn

from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.core.process import exit_without_teardown
from pagedserve.engine.worker import EMBEDDED_NAME
from pagedserve.server import offline
from pagedserve.server.app import create_app
from pagedserve.server.benchmark.command import add_bench_commands
from pagedserve.server.context import ServerSettings
from pagedserve.server.door import Door
from pagedserve.server.engine_args import add_engine_args, engine_config
from pagedserve.server.http_protocol import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    guarded_protocol,
)
from pagedserve.server.logs import LOG_FORMATS, configure_logging, uvicorn_text_logging
from pagedserve.server.offline import LOG_LEVELS
from pagedserve.server.reasoning import THINK_PARSERS
from pagedserve.server.settings import add_listen_args, positive
from pagedserve.server.shutdown import ABORT_GRACE_SECONDS, DrainingServer
from pagedserve.server.tools import AUTO_TOOL_PARSERS

logger = logging.getLogger("pagedserve")
API_KEY_ENV = "PAGEDSERVE_API_KEY"
TOKENIZER_IMPORTS = ("transformers.activations", "transformers.models.auto.tokenization_auto")


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
    names = args.served_model_name or [config.served_model_name or config.model or EMBEDDED_NAME]
    settings = ServerSettings(
        names,
        api_key=args.api_key,
        cors_allowed_origins=args.cors_allowed_origins,
        max_request_bytes=args.max_request_bytes,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        web_page=not args.disable_web_page,
    )
    engine = AsyncEngine.from_config(config)
    app = create_app(engine, settings)
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=None if args.log_format == "json" else uvicorn_text_logging(),  # None: ours, via root
        timeout_graceful_shutdown=ABORT_GRACE_SECONDS,  # the drain has already run when uvicorn waits
        http=guarded_protocol(
            args.header_timeout, args.max_connections, Door(app.state.serving), body_timeout=args.body_timeout
        ),
        root_path=args.root_path,
    )
    server = DrainingServer(uvicorn_config, app.state.serving, args.shutdown_timeout)
    engine.on_death(lambda: _stop_serving(server))
    engine.start()  # the core loads in its own process while uvicorn starts listening: /ready says 503 until then
    threading.Thread(target=_warm_tokenizer_imports, name="pagedserve-warm-imports", daemon=True).start()
    threading.Thread(target=_stop_if_load_fails, args=(engine, server), daemon=True).start()
    try:
        server.run()
    finally:
        engine.shutdown()
    # Connections are closed and the core has ended: nothing is left that the interpreter's teardown would do
    # but free torch's, transformers' and the tokenizer's objects one by one, seconds of CPU on a stop's clock.
    exit_without_teardown(0 if engine.is_healthy else 1)


def _warm_tokenizer_imports() -> None:
    """Imports now, while the core loads, what loading the tokenizer will import once the core is ready:
    transformers' configuration and activation modules pull in torch.distributed's tensor package, 2-4 s that
    would otherwise come after the model has loaded, before /ready turns 200."""
    for name in TOKENIZER_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # another transformers release: the tokenizer's load imports what it needs
            logger.debug("could not import %s ahead of the tokenizer", name)


def _stop_serving(server: DrainingServer) -> None:
    """The engine core died: /health says 503 and requests in flight have failed; exit 1, to be restarted."""
    logger.error("the engine core is gone; shutting down")
    server.drain()


def _stop_if_load_fails(engine: AsyncEngine, server: uvicorn.Server) -> None:
    if not engine.wait_ready():
        logger.error("the model failed to load (%s); stopping", engine.unavailable_reason())
        server.should_exit = True
    else:
        logger.info("the model is loaded: ready to serve")


if __name__ == "__main__":
    sys.exit(main())
