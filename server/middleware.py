"""Plain ASGI middleware (no response buffering, so SSE streams pass straight through)."""

from __future__ import annotations

import hmac
import re
import uuid
from dataclasses import dataclass

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.engine import QueueFullError
from pagedserve.server.context import ServingContext
from pagedserve.server.errors import APIError, to_api_error
from pagedserve.server.logs import RequestRecord

REQUEST_ID_HEADER = "X-Request-Id"
_VALID_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces: safe in logs and headers
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapers carry no API key (nor log lines)
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class RequestContextMiddleware:
    """Names each request (the client's X-Request-Id, else a new one; echoed back), counts it in flight for the
    shutdown drain, and at its end counts its response and writes its request-log line."""

    def __init__(self, app: ASGIApp, serving: ServingContext) -> None:
        self.app = app
        self.serving = serving

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = Headers(scope=scope).get(REQUEST_ID_HEADER, "")
        request_id = incoming if _VALID_REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex
        record = RequestRecord(request_id, scope["method"], scope["path"])
        scope.setdefault("state", {}).update(request_id=request_id, record=record)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        # Requests that arrive while draining are refused at once: the drain need not wait for them.
        in_flight = 0 if self.serving.draining else 1
        self.serving.in_flight += in_flight
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.serving.in_flight -= in_flight
            route = getattr(scope.get("route"), "path", "unmatched")  # the template, not the raw path
            self.serving.metrics.observe_http(route, scope["method"], record.status)
            if scope["path"] not in OPEN_PATHS:
                record.log()


class BodyLimitMiddleware:
    """Refuses request bodies over `max_bytes` with 413, before anything parses them.

    The body is read here (up to the limit) and replayed to the app: a chunked body has no length to check
    up front, and a limit hit halfway through the app's own read could no longer become a clean 413.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        message = await receive()
        while message["type"] == "http.request":
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
            message = await receive()
        record = _record(scope)
        if record is not None:
            record.received()
        pending = [message]  # the whole body, or the disconnect that cut it short

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is over {self.max_bytes} bytes", code="request_too_large")
        record = _record(scope)
        if record is not None:
            record.error_code = error.code
        await error.response()(scope, receive, send)


@dataclass(frozen=True)
class _ShedRoute:
    path: str  # what the HTTP metrics label a request with (a routed request's APIRoute has it too)


class LoadSheddingMiddleware:
    """Answers generation requests 503 + Retry-After while the engine's waiting queue is full, before their
    bodies are parsed, templated or tokenized: under overload, refusing must cost next to nothing. The engine
    decides (AsyncEngine.check_admission); a request that gets past here may still be refused by generate().
    """

    def __init__(self, app: ASGIApp, serving: ServingContext) -> None:
        self.app = app
        self.serving = serving

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
            try:
                self.serving.engine.check_admission()
            except QueueFullError as exc:
                scope["route"] = _ShedRoute(scope["path"])
                error = to_api_error(exc, "prompt")
                record = _record(scope)
                if record is not None:
                    record.error_code = error.code
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _record(scope: Scope) -> RequestRecord | None:
    """The request log's entry, when RequestContextMiddleware wraps this one."""
    return scope.get("state", {}).get("record")


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on every route but the probes and /metrics."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(
            401,
            "invalid or missing API key: send it as 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error.response()(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = Headers(scope=scope).get("authorization", "").encode()
        return hmac.compare_digest(given, self._expected)
