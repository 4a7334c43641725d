"""Graceful shutdown: a uvicorn server that drains in-flight requests on SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import types

import uvicorn

from pagedserve.engine.client.async_stream import EngineUnavailableError
from pagedserve.server.context import ServingContext

logger = logging.getLogger("pagedserve")
ABORT_GRACE_SECONDS = 5  # for aborted requests to send their error event, and for uvicorn to close connections


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM or SIGINT, /ready and every new request answer 503 at once while the listener stays
    open (a client still gets an answer, not a refused connection); requests in flight get `shutdown_timeout`
    seconds to finish; the rest are then aborted (streams end with an error event) and uvicorn shuts down, so
    the process exits 0. A second signal skips the drain: uvicorn's own handling, and its exit status.
    """

    def __init__(self, config: uvicorn.Config, serving: ServingContext, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._serving = serving
        self._shutdown_timeout = shutdown_timeout
        self._drain: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
        if self._serving.draining:
            super().handle_exit(sig, frame)
        else:
            self.drain()

    def drain(self) -> None:
        """Starts the drain; safe from a signal handler or another thread (it only sets a flag: on_tick acts)."""
        self._serving.draining = True

    async def on_tick(self, counter: int) -> bool:
        if self._serving.draining and self._drain is None:
            self._drain = asyncio.create_task(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        serving = self._serving
        logger.info(
            "shutting down: %d requests in flight get up to %g s to finish", serving.in_flight, self._shutdown_timeout
        )
        if not await serving.wait_idle(self._shutdown_timeout):
            logger.warning("shutdown timeout: aborting the %d requests still in flight", serving.in_flight)
            serving.engine.fail_all(EngineUnavailableError("the server shut down before the request finished"))
            await serving.wait_idle(ABORT_GRACE_SECONDS)
        self.should_exit = True
