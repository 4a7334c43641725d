"""The HTTP/1.1 protocol `pagedserve serve` runs: uvicorn's httptools protocol (llhttp, a C parser: a request costs
a fifth of what h11's pure-Python parser costs, which a burst of hundreds adds up) with these additions.

- Load shedding at the door: as soon as a request's headers are parsed, a Door (server/door.py) admits it,
  reserving its place in the engine's queue, or refuses it; the 503 is written right here, inside the read
  callback, before any ASGI task exists, so no refusal waits behind the admitted requests' work. The refused
  request's body is read and dropped and the connection stays open for the next one. An admitted request's
  place comes back when its ASGI request cycle ends, whatever happened in it (an answer from any middleware,
  an exception, a body that never came): the app this protocol runs is wrapped to release it then.
- Header timeout: a deadline starts when a connection opens and when each request-response cycle ends, and
  stops once the next request's headers are complete; when it passes, the connection is closed. A request's
  body and its answer (an SSE stream of any length) are not under it. uvicorn has none (slowloris): its
  keep-alive timer stops at the first byte of the next request, so a client that trickles its headers would hold
  a connection (and a file descriptor) for ever. An idle keep-alive connection closes after the shorter of
  uvicorn's keep-alive timeout and this one.
- Body timeout: a request's body must be in `body_timeout` seconds after the read that completed its headers
  (a pipelined request's, after it starts), however it trickles in; when it is not, the request is answered an
  OpenAI-shaped 408 `body_timeout` and the connection is closed. The app sees the client gone (its request log
  and metrics say 408) and the request's queue place comes back: headers announcing a body that never comes
  cannot hold a place. A request answered before its body is in (401, 413, 503) is under the header timeout
  again, not this one.
- Connection cap: a connection opened while `max_connections` are open (idle ones included: they cost the
  same) is answered at once with an OpenAI-shaped 503 and Retry-After, then closed. Such a connection is never
  handed to the app: no request-log line, no metrics. (uvicorn's `limit_concurrency` answers only once a
  request's headers are in, so it cannot refuse connections that never complete them.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
from http import HTTPStatus
from typing import Any, cast

import httptools
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pagedserve.server.admission import release_ticket
from pagedserve.server.door import Door, Refusal
from pagedserve.server.errors import RETRY_AFTER_SECONDS, APIError, server_error
from pagedserve.server.middleware import REQUEST_ID_HEADER, answered_by_protocol
from pagedserve.server.settings import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS

logger = logging.getLogger(__name__)
MAX_HEADER_BYTES = 64 * 1024  # a request's line and headers; more is answered 431 and the connection closed
REFUSAL_LINGER_SECONDS = 2.0  # how long a refused connection may keep sending before it is cut off
REFUSAL_LOG_INTERVAL = 10.0  # a flood of refusals logs one warning per interval, not one per connection


def _closing_response(error: APIError) -> bytes:
    """An OpenAI-shaped error answer after which the connection closes."""
    body = json.dumps(error.body()).encode()
    status = HTTPStatus(error.status_code)
    head = [f"HTTP/1.1 {status.value} {status.phrase}", "content-type: application/json"]
    head += [
        f"content-length: {len(body)}",
        *(f"{name.lower()}: {value}" for name, value in (error.headers or {}).items()),
    ]
    return ("\r\n".join([*head, "connection: close", "", ""])).encode() + body


_REFUSAL = _closing_response(
    server_error(
        503,
        "the server has too many open connections; retry later",
        "too_many_connections",
        {"retry-after": RETRY_AFTER_SECONDS},
    )
)
_HEADERS_TOO_LARGE = _closing_response(
    APIError(431, f"the request's headers are over {MAX_HEADER_BYTES} bytes", code="request_headers_too_large")
)


def _body_timeout_error(timeout: float, request_id: str | None) -> APIError:
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    message = f"the request body did not arrive within {timeout:g} s of its headers"
    return APIError(408, message, code="body_timeout", headers=headers)


class _ReleasingPlaces:
    """The app, giving back the queue place a request holds (server/admission.py) when its ASGI cycle ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            release_ticket(scope.get("state", {}))


class _ClosingAnswer(asyncio.Protocol):
    """Writes an answer, then discards what the client sends until it closes or the linger ends. Closing at once
    would leave its request unread, and closing a socket with unread data makes the kernel reset the connection,
    which can destroy the answer before the client reads it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, answer: bytes) -> None:
        self._loop = loop
        self._answer = answer
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self._answer)
        if transport.can_write_eof():
            transport.write_eof()  # the client sees the end of the answer while we still read
        self._linger = self._loop.call_later(REFUSAL_LINGER_SECONDS, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()


class GuardedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with a door, header and body timeouts and a connection cap; see guarded_protocol()."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    door: Door | None = None
    _last_refusal_log = -REFUSAL_LOG_INTERVAL  # shared by every connection of the class
    _header_deadline: asyncio.TimerHandle | None = None
    _body_deadline: asyncio.TimerHandle | None = None
    _dropping_body = False  # the request being read was answered at the door
    _header_bytes: int | None = None  # bytes of the request headers being read; None between them
    _message_began = False  # in the chunk being parsed

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.app = cast(Any, _ReleasingPlaces(self.app))

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._start_header_clock()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_clock()
        self._stop_body_clock()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._message_began = False
        super().data_received(data)
        # Count the chunks of headers still incomplete; a chunk that began them may end the previous request's
        # body too, so it is left out: the cap may be passed by one read (256 KiB) at most.
        if self._header_bytes is not None and not self._message_began and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES:
                self._close_with(_HEADERS_TOO_LARGE)
                return
        # A request whose headers are in and whose body is not: its clock starts now (and runs on, however its
        # body trickles in). A request complete in this chunk, the usual case, never needs one.
        self._start_body_clock()

    # ---- parser callbacks ----------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes, self._message_began = 0, True

    def on_headers_complete(self) -> None:
        self._stop_header_clock()
        # The keep-alive timer is cancelled when data comes in, but an answer given at the door re-arms it
        # mid-chunk: a request whose headers followed in the same chunk must not be cut off by it.
        self._unset_keepalive_if_required()
        self._header_bytes = None
        if not self._answered_at_door():
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._dropping_body:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._dropping_body:
            self._dropping_body = False
            return
        self._stop_body_clock()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._stop_body_clock()  # answered: a body still due is the header timeout's, as after any answer
        next_request_in = bool(self.pipeline)
        super().on_response_complete()  # may start a pipelined request whose headers were already in
        if not self.transport.is_closing():
            if not next_request_in:
                self._start_header_clock()
            self._start_body_clock()  # a pipelined request started, its body still to come

    # ---- the door ------------------------------------------------------------------------------------

    def _answered_at_door(self) -> bool:
        """Asks the door about the request whose headers just came in; writes its refusal if it has one. Only
        a plain request is asked: one that queues behind a response still being written (pipelined), awaits
        100-continue, upgrades, or closes the connection after its answer goes to the app as it is."""
        busy = self.cycle is not None and not self.cycle.response_complete
        if self.door is None or busy or self.expect_100_continue or self.parser.should_upgrade():
            return False
        if not self.parser.should_keep_alive():
            return False
        try:
            parsed_url = httptools.parse_url(self.url)
        except httptools.HttpParserInvalidURLError:
            return False  # the app's path answers it as uvicorn does
        path = parsed_url.path.decode("ascii", "replace")
        path = urllib.parse.unquote(path) if "%" in path else path
        method = self.parser.get_method().decode("ascii", "replace")
        refusal = self.door.admit(method, path, self.root_path + path, self.headers, self.scope["state"])
        if refusal is None:
            return False
        self._dropping_body = True
        self._write(refusal)
        self._log_access(method, self.root_path + path, parsed_url.query, refusal.status)
        self.on_response_complete()  # the keep-alive timer and the header clock, as after any answer
        return True

    def _write(self, refusal: Refusal) -> None:
        status = HTTPStatus(refusal.status)
        content = [b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode())]
        for name, value in [*self.server_state.default_headers, *refusal.headers]:
            content += [name, b": ", value, b"\r\n"]
        content += [b"\r\n", refusal.body]
        self.transport.write(b"".join(content))

    def _log_access(self, method: str, path: str, query: bytes | None, status: int) -> None:
        """uvicorn's access-log line, as its cycle writes it for the app's answers."""
        if self.access_log:
            target = f"{path}?{query.decode('ascii', 'replace')}" if query else path
            client = f"{self.client[0]}:{self.client[1]}" if self.client else ""
            self.access_logger.info('%s - "%s %s HTTP/%s" %d', client, method, target, "1.1", status)

    # ---- the guards ----------------------------------------------------------------------------------

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
            self.transport.close()  # connection_lost does uvicorn's bookkeeping

    def _start_body_clock(self) -> None:
        """Starts the clock of the body of the request being read, when one is due and can be read now."""
        cycle = self.cycle
        if cycle is None or not cycle.more_body or cycle.response_complete or self._body_deadline is not None:
            return
        if self.transport.is_closing() or any(queued is cycle for queued, _ in self.pipeline):
            return  # a pipelined request not started yet, behind an answer: its clock starts when it does
        self._body_deadline = self.loop.call_later(self.body_timeout, self._body_timeout_expired)

    def _stop_body_clock(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _body_timeout_expired(self) -> None:
        self._body_deadline = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or cycle.response_complete:
            return
        logger.debug("closing %s: no complete request body in %g s", self.client, self.body_timeout)
        if cycle.response_started:  # an app answering before the body is in: too late for a 408
            self.transport.close()
            return
        scope = cycle.scope
        error = _body_timeout_error(self.body_timeout, scope["state"].get("request_id"))
        answered_by_protocol(scope["state"], error)  # the app sees the client gone, and logs and counts this
        self._log_access(scope["method"], scope["path"], scope["query_string"], error.status_code)
        self._close_with(_closing_response(error))

    def _close_with(self, answer: bytes) -> None:
        """Answers and closes this connection, which uvicorn then forgets as if the client had gone."""
        self._stop_header_clock()
        self._stop_body_clock()
        self._unset_keepalive_if_required()
        self.connections.discard(self)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # a response still streaming on this connection ends
            self.cycle.message_event.set()
        _hand_over(self.transport, _ClosingAnswer(self.loop, answer))

    def _refuse(self, transport: asyncio.Transport) -> None:
        now = time.monotonic()
        if now - GuardedHttpProtocol._last_refusal_log >= REFUSAL_LOG_INTERVAL:
            GuardedHttpProtocol._last_refusal_log = now
            logger.warning("refusing connections: %d are open (--max-connections)", len(self.connections))
        _hand_over(transport, _ClosingAnswer(self.loop, _REFUSAL))


def _hand_over(transport: asyncio.Transport, protocol: asyncio.Protocol) -> None:
    transport.set_protocol(protocol)  # what the client sends from now on goes to `protocol`
    protocol.connection_made(transport)


def guarded_protocol(
    header_timeout: float,
    max_connections: int,
    door: Door | None = None,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
) -> type[GuardedHttpProtocol]:
    """The protocol class to pass as uvicorn.Config(http=...), with these limits and, if given, this door."""

    class Configured(GuardedHttpProtocol):
        pass

    Configured.header_timeout = header_timeout
    Configured.body_timeout = body_timeout
    Configured.max_connections = max_connections
    Configured.door = door
    return Configured
