"""The `pagedserve` command: `serve` (OpenAI-compatible HTTP server), `generate` and `chat` (offline)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import types
from collections.abc import Sequence

import uvicorn

from engine.async_engine import AsyncEngine
from engine.loader import EMBEDDED_NAME
from server import offline
from server.app import create_app
from server.context import ServerSettings, ServingContext
from server.engine_args import add_engine_args, engine_config
from server.offline import LOG_LEVELS

logger = logging.getLogger("pagedserve")
API_KEY_ENV = "PAGEDSERVE_API_KEY"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)

    def print_help(_: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(run=print_help, log_level="warning")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_serve(commands)
    offline.add_commands(commands)
    return parser


def _add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API; /ready turns 200 once it has loaded.",
    )
    serve.add_argument("model_path", nargs="?", metavar="MODEL", help="same as --model")
    http = serve.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="127.0.0.1 (default) or 0.0.0.0 for every interface")
    http.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    http.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="names clients may use; the first is reported (default: the engine's served_model_name, else the model)",
    )
    http.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV), help=f"require this bearer key (or set {API_KEY_ENV})"
    )
    http.add_argument("--cors-allowed-origins", nargs="*", default=[], metavar="ORIGIN", help="(default: none)")
    http.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="(default: info)")
    add_engine_args(serve, exclude=frozenset({"served_model_name"}))
    serve.set_defaults(run=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    config = engine_config(args, model=args.model_path)
    names = args.served_model_name or [config.served_model_name or config.model or EMBEDDED_NAME]
    settings = ServerSettings(names, api_key=args.api_key, cors_allowed_origins=args.cors_allowed_origins)
    engine = AsyncEngine.from_config(config)
    app = create_app(engine, settings)
    server = _DrainingServer(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level), app.state.serving
    )
    engine.start()  # loads on its own thread while uvicorn starts listening: /ready says 503 until it is done
    threading.Thread(target=_stop_if_load_fails, args=(engine, server), daemon=True).start()
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0 if engine.is_healthy else 1


class _DrainingServer(uvicorn.Server):
    """Turns /ready to 503 the moment shutdown begins, so load balancers stop routing here first."""

    def __init__(self, config: uvicorn.Config, serving: ServingContext) -> None:
        super().__init__(config)
        self._serving = serving

    def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
        self._serving.draining = True
        super().handle_exit(sig, frame)


def _stop_if_load_fails(engine: AsyncEngine, server: uvicorn.Server) -> None:
    if not engine.wait_ready():
        logger.error("the model failed to load (%s); stopping", engine.unavailable_reason())
        server.should_exit = True
    else:
        logger.info("the model is loaded: ready to serve")


if __name__ == "__main__":
    sys.exit(main())
