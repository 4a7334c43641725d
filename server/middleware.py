"""Plain ASGI middleware (no response buffering, so SSE streams pass straight through)."""

from __future__ import annotations

import asyncio
import email.message
import hmac
import json
import logging
import re
import uuid
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.engine import QueueFullError
from pagedserve.server.admission import AdmissionTicket, put_ticket, release_ticket, ticket_in
from pagedserve.server.context import ServingContext
from pagedserve.server.errors import CLIENT_CLOSED_REQUEST, APIError, internal_error, invalid_request, to_api_error
from pagedserve.server.request_log import RequestRecord

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
_VALID_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces: safe in logs and headers
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapers carry no API key (nor log lines)
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/completion"})
_PROTOCOL_ANSWER = "protocol_answer"  # scope state: the APIError the protocol answered a request with


class RequestContextMiddleware:
    """Names each request (the client's X-Request-Id, else a new one; echoed back), counts it in flight for the
    shutdown drain, and at its end counts its response and writes its request-log line.

    It also answers any unexpected exception: here, inside the request's context, the 500 carries the request id
    and lands in the request log, and returning (not re-raising, as Starlette's ServerErrorMiddleware does) keeps
    uvicorn from logging a second traceback and closing the keep-alive connection.
    """

    def __init__(self, app: ASGIApp, serving: ServingContext) -> None:
        self.app = app
        self.serving = serving

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = valid_request_id(Headers(scope=scope).get(REQUEST_ID_HEADER, ""))
        record = RequestRecord(request_id, scope["method"], scope["path"])
        scope.setdefault("state", {}).update(request_id=request_id, record=record)

        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                record.status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        # Requests that arrive while draining are refused at once: the drain need not wait for them.
        in_flight = 0 if self.serving.draining else 1
        self.serving.in_flight += in_flight
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            logger.error("request %s failed", request_id, exc_info=exc)
            error = internal_error()
            record.error_code = error.code
            if not started:
                await error.response()(scope, receive, send_with_id)
            # else the response is cut short: uvicorn closes the connection, which tells the client it broke
        finally:
            self.serving.in_flight -= in_flight
            route = getattr(scope.get("route"), "path", "unmatched")  # the template, not the raw path
            self.serving.metrics.observe_http(route, scope["method"], record.status)
            if route_path(scope) not in OPEN_PATHS:
                record.log()


class BodyLimitMiddleware:
    """Refuses request bodies over `max_bytes` with 413, and bodies holding a lone UTF-16 surrogate with 400
    `invalid_unicode`, before anything parses them. A client that hangs up before its body is in is recorded as
    499 `client_closed` (or as what the protocol answered it: a 408 at the body timeout), and the app never runs.

    The body is read here (up to the limit) and replayed to the app: a chunked body has no length to check
    up front, and a limit hit halfway through the app's own read could no longer become a clean 413.

    Every body this API takes is a JSON document, and OpenAI's API reads it as JSON whatever its Content-Type
    says (none, text/plain, or curl -d's application/x-www-form-urlencoded): so does the app, which is told here
    that the body is application/json (FastAPI parses a body only under a JSON content type).
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, self._too_large())
            return
        chunks: list[bytes] = []
        size = 0
        message = await receive()
        while message["type"] == "http.request":
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, self._too_large())
                return
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
            message = await receive()
        if message["type"] == "http.disconnect":
            _client_closed(scope)
            return
        record = _record(scope)
        if record is not None:
            record.received()
        if has_lone_surrogate(message["body"]):
            await self._refuse(scope, receive, send, _invalid_unicode())
            return
        if not _is_json(headers.get("content-type")):
            _read_as_json(scope)
        pending = [message]  # the whole body

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is over {self.max_bytes} bytes", code="request_too_large")

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
        record = _record(scope)
        if record is not None:
            record.error_code = error.code
        await error.response()(scope, receive, send)


def _invalid_unicode() -> APIError:
    message = "the request body holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its pair)"
    message += ": it is not valid Unicode text"
    return invalid_request(message, "invalid_unicode")


# A high-surrogate escape not followed by a low one, or a low one not preceded by a high one. It may match
# where no surrogate is (an escaped backslash then "ud800" is plain text): has_lone_surrogate checks exactly.
_HIGH, _LOW = rb"\\ud[89ab][0-9a-f]{2}", rb"\\ud[c-f][0-9a-f]{2}"
_LONE_SURROGATE_ESCAPE = re.compile(rb"%s(?!%s)|(?<!%s)%s" % (_HIGH, _LOW, _HIGH, _LOW), re.IGNORECASE)


def has_lone_surrogate(body: bytes) -> bool:
    """Whether a JSON body decodes to a string holding an unpaired surrogate: no tokenizer, nor the UTF-8 JSON
    encoder of an answer echoing it, can take one. The regex keeps the exact check off ordinary bodies."""
    if not _LONE_SURROGATE_ESCAPE.search(body):
        return False
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # before ValueError, its base class
        return True
    except (ValueError, RecursionError):  # not JSON, or too deep to read: the app's own parsing answers that
        return False
    return False


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this content type as JSON: application/json or application/*+json."""
    if not content_type:
        return False
    parsed = email.message.Message()
    parsed["content-type"] = content_type
    subtype = parsed.get_content_subtype()
    return parsed.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _read_as_json(scope: Scope) -> None:
    """Tells the app the body is JSON, in place of the content type it came with (or none)."""
    headers = [(name, value) for name, value in scope["headers"] if name != b"content-type"]
    scope["headers"] = [*headers, (b"content-type", b"application/json")]


def _client_closed(scope: Scope) -> None:
    """The client hung up before its body was in, or the protocol answered it and closed the connection (the body
    timeout): nobody reads an answer from the app, the log and metrics show a 499 or the protocol's answer."""
    record = _record(scope)
    if record is None:
        return
    if route_path(scope) in GENERATION_PATHS:  # the router never runs: other paths count as "unmatched"
        scope["route"] = _RouteLabel(route_path(scope))
    answered = scope.get("state", {}).get(_PROTOCOL_ANSWER)
    if isinstance(answered, APIError):
        record.status, record.error_code = answered.status_code, answered.code
        logger.debug("request %s: answered %d by the protocol", record.request_id, answered.status_code)
        return
    record.status = CLIENT_CLOSED_REQUEST
    record.error_code = "client_closed"
    logger.debug("request %s: the client hung up before its body was in", record.request_id)


def answered_by_protocol(state: MutableMapping[str, Any], error: APIError) -> None:
    """Notes in a request's scope state that the HTTP protocol answered it `error` and cut its connection (its
    body did not arrive in time): the app, which then sees the client gone, logs and counts that answer."""
    state[_PROTOCOL_ANSWER] = error


@dataclass(frozen=True)
class _RouteLabel:
    """The route of a request the router never saw, for the HTTP metrics: one of a few fixed paths, never one
    a client made up (a routed request's APIRoute has a `path` too)."""

    path: str


class LoadSheddingMiddleware:
    """Answers generation requests 503 + Retry-After while the engine's waiting queue is full, before their
    bodies are parsed, templated or tokenized: under overload, refusing must cost next to nothing.

    Each generation request brings the place the protocol's door reserved as its headers were parsed
    (server/door.py), or reserves it here (AsyncEngine.reserve_place), then yields once to the event loop: in a
    burst, every request is admitted or refused before any admitted one parses its body, so the refusals do not
    wait behind that work. Its AdmissionTicket (server/admission.py) carries the place to the handler, which
    hands it to generate(), which may still refuse the request (n places needed, not one); a request that never
    gets there gives its place back as this returns (and in any case when its ASGI cycle ends: the protocol
    releases whatever ticket the scope's state holds then, a door's place answered outside this middleware too).
    """

    def __init__(self, app: ASGIApp, serving: ServingContext) -> None:
        self.app = app
        self.serving = serving

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        ticket = ticket_in(state)  # admitted at the door (server/door.py) when the protocol has one, else here
        try:
            if ticket is None:
                ticket = AdmissionTicket(self.serving.engine.reserve_place())
        except QueueFullError as exc:
            scope["route"] = _RouteLabel(route_path(scope))
            error = to_api_error(exc, "prompt")
            record = _record(scope)
            if record is not None:
                record.error_code = error.code
            await error.response()(scope, receive, send)
            return
        put_ticket(state, ticket)
        try:
            await asyncio.sleep(0)  # the rest of a burst is admitted or refused before this request's work
            await self.app(scope, receive, send)
        finally:
            release_ticket(state)


def route_path(scope: Scope) -> str:
    """The path the routes match: behind --root-path, uvicorn puts the root path in front of scope["path"]."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


def _record(scope: Scope) -> RequestRecord | None:
    """The request log's entry, when RequestContextMiddleware wraps this one."""
    return scope.get("state", {}).get("record")


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on every route but `open_paths`: the probes and /metrics, and the web
    page's files, which then ask for the key."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self._expected = api_key.encode()
        self._open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in self._open_paths or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(
            401,
            "invalid or missing API key: send it once, as 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error.response()(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        return api_key_matches(scope["headers"], self._expected)


def valid_request_id(incoming: str) -> str:
    """The client's X-Request-Id when it is safe in logs and headers, else a new one."""
    return incoming if _VALID_REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex


def api_key_matches(headers: Iterable[tuple[bytes, bytes]], expected: bytes) -> bool:
    """Whether a request's headers (as the protocol parsed them: names in lower case, the bytes the client sent)
    carry the API key: exactly one Authorization header, `Bearer <expected>`. The one reading both the door
    (server/door.py) and ApiKeyMiddleware make: two Authorization headers are refused whatever they say, since
    one reader taking the first and another the last would let a request through one check and not the other."""
    values = [value for name, value in headers if name == b"authorization"]
    return len(values) == 1 and _bearer_key_matches(values[0], expected)


def _bearer_key_matches(authorization: bytes, expected: bytes) -> bool:
    """Whether an Authorization header's value is `Bearer <expected>`: the scheme in any case, as RFC 7235 has it,
    the key compared in constant time."""
    scheme, _, key = authorization.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(b" "), expected)
