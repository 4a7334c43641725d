"""A uvicorn server on a background thread: for tests and benchmarks that need a real socket in-process."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI


class BackgroundServer:
    """`with BackgroundServer(app) as server:` serves on 127.0.0.1 at a free port until the block ends."""

    def __init__(
        self, app: FastAPI, log_level: str = "warning", startup_timeout: float = 30.0, **uvicorn_options: Any
    ) -> None:
        # A short graceful shutdown: a test that failed mid-stream must not hang on its open connection.
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level=log_level, timeout_graceful_shutdown=5, **uvicorn_options
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
        self._startup_timeout = startup_timeout
        self.url = ""

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
