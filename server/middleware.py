"""Plain ASGI middleware (no response buffering, so SSE streams pass straight through)."""

from __future__ import annotations

import hmac
import re
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError
from server.metrics import ServerMetrics

REQUEST_ID_HEADER = "X-Request-Id"
_VALID_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces: safe in logs and headers
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapers carry no API key


class RequestContextMiddleware:
    """Names each request (the client's X-Request-Id, else a new one; echoed back) and counts responses."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = Headers(scope=scope).get(REQUEST_ID_HEADER, "")
        request_id = incoming if _VALID_REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500  # what the client sees if the app fails before answering

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")  # the template, not the raw path
            self.metrics.observe_http(route, scope["method"], status)


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
