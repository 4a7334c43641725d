"""uvicorn's h11 protocol with two guards against slow or idle clients (slowloris): a header-read timeout and a
cap on open connections.

uvicorn has neither: its keep-alive timer runs only between requests and stops at the first byte of the next
one, so a client that trickles its request headers holds a connection (and a file descriptor) for ever, and
nothing bounds how many such connections it opens. Its `limit_concurrency` answers 503 only once a request's
headers are in, so it cannot refuse connections that never complete them.

- Header timeout: a deadline starts when a connection opens and when each request-response cycle ends, and
  stops once the next request's headers are complete; when it passes, the connection is closed. A request's
  body and its answer (an SSE stream of any length) are not under it. An idle keep-alive connection therefore
  closes after the shorter of uvicorn's keep-alive timeout and this one.
- Connection cap: a connection opened while `max_connections` are open (idle ones included: they cost the
  same) is answered at once with an OpenAI-shaped 503 and Retry-After, then closed. Such a connection is never
  handed to the app: no request-log line, no metrics.

Always h11: uvicorn's `auto` picks httptools when it is installed, which pagedserve does not depend on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.server.errors import RETRY_AFTER_SECONDS, server_error

logger = logging.getLogger(__name__)
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds
DEFAULT_MAX_CONNECTIONS = 1024
REFUSAL_LINGER_SECONDS = 2.0  # how long a refused connection may keep sending before it is cut off
REFUSAL_LOG_INTERVAL = 10.0  # a flood of refusals logs one warning per interval, not one per connection


def _refusal_response() -> bytes:
    error = server_error(503, "the server has too many open connections; retry later", "too_many_connections")
    body = json.dumps(error.body()).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        f"retry-after: {RETRY_AFTER_SECONDS}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


_REFUSAL = _refusal_response()


class _Refusal(asyncio.Protocol):
    """Answers 503 before reading anything, then discards what the client sends until it closes or the linger
    ends. Closing at once would leave its request unread, and closing a socket with unread data makes the kernel
    reset the connection, which can destroy the 503 before the client reads it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_REFUSAL)
        if transport.can_write_eof():
            transport.write_eof()  # the client sees the end of the answer while we still read
        self._linger = self._loop.call_later(REFUSAL_LINGER_SECONDS, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with a header-read timeout and a connection cap; see guarded_protocol() for its settings."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    _last_refusal_log = -REFUSAL_LOG_INTERVAL  # shared by every connection of the class
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._start_header_clock()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_clock()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        scope = self.scope
        super().data_received(data)
        if self.scope is not scope:  # h11 parsed a request's headers: a new cycle (or an upgrade) has begun
            self._stop_header_clock()

    def on_response_complete(self) -> None:
        scope = self.scope
        super().on_response_complete()  # may start a pipelined request whose headers were already in
        if self.scope is scope and not self.transport.is_closing():
            self._start_header_clock()

    def _start_header_clock(self) -> None:
        self._stop_header_clock()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._header_timeout_expired)

    def _stop_header_clock(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_timeout_expired(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            logger.debug("closing %s: no complete request headers in %g s", self.client, self.header_timeout)
            self.transport.close()  # connection_lost does h11's and uvicorn's bookkeeping

    def _refuse(self, transport: asyncio.Transport) -> None:
        now = time.monotonic()
        if now - GuardedH11Protocol._last_refusal_log >= REFUSAL_LOG_INTERVAL:
            GuardedH11Protocol._last_refusal_log = now
            logger.warning("refusing connections: %d are open (--max-connections)", len(self.connections))
        refusal = _Refusal(self.loop)
        transport.set_protocol(refusal)  # what the client sends from now on goes to the refusal
        refusal.connection_made(transport)


def guarded_protocol(header_timeout: float, max_connections: int) -> type[GuardedH11Protocol]:
    """The protocol class to pass as uvicorn.Config(http=...), with these limits."""

    class Configured(GuardedH11Protocol):
        pass

    Configured.header_timeout = header_timeout
    Configured.max_connections = max_connections
    return Configured
