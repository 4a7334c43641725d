"""`pagedserve serve`'s server: the app, uvicorn and the drain around an engine core that is loading.

Imported by the CLI only after it has started the core: these imports (FastAPI, pydantic's models, the engine's
client) take a second or two that the core spends importing torch and loading the model at the same time. This
process never imports torch or transformers: the core describes its tokenizer (engine/text/text_tokenizer.py).
"""

from __future__ import annotations

import argparse
import logging
import threading
from typing import NoReturn

import uvicorn

from pagedserve.engine import AsyncEngine, EngineConfig
from pagedserve.engine.config import EMBEDDED_NAME
from pagedserve.engine.core.process import CoreConnection, exit_without_teardown
from pagedserve.server.app import create_app
from pagedserve.server.context import ServerSettings
from pagedserve.server.door import Door
from pagedserve.server.http_protocol import guarded_protocol
from pagedserve.server.logs import uvicorn_text_logging
from pagedserve.server.shutdown import ABORT_GRACE_SECONDS, DrainingServer

logger = logging.getLogger("pagedserve")


def run_server(args: argparse.Namespace, config: EngineConfig, core: CoreConnection) -> NoReturn:
    """Serves `config`'s model over HTTP until stopped, with the engine `core` (started already, or not)."""
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
    engine = AsyncEngine(core)
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
    engine.start()  # a no-op where the core runs already; /ready says 503 until it has loaded
    threading.Thread(target=_stop_if_load_fails, args=(engine, server), daemon=True).start()
    try:
        server.run()
    finally:
        engine.shutdown()
    # Connections are closed and the core has ended: nothing is left that the interpreter's teardown would do
    # but free the app's and the tokenizer's objects one by one, CPU time on a stop's clock.
    exit_without_teardown(0 if engine.is_healthy else 1)


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
