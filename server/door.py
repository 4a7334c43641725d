"""Load shedding at the door: a generation request is admitted or refused as soon as its headers are parsed.

The HTTP protocol (server/http_protocol.py) asks the door about each request the moment its headers are in,
inside the event loop's read callback, before any ASGI task exists. An admitted request leaves with a reserved
place in the engine's waiting queue (its AdmissionTicket, server/admission.py, which LoadSheddingMiddleware
takes); a refused one gets its whole 503 + Retry-After answer from here, written by the protocol at once. So in
a burst, every request the queue cannot take is answered while it is read, never behind the parsing, templating
and tokenization of the admitted ones, and a refusal costs the parse and one write (vLLM and SGLang refuse only
from their handlers).

The door only refuses what the app would refuse the same way, with the same answer, request-log line and HTTP
metrics: a request it is unsure of (draining, an unauthorized key, a CORS origin whose headers the app adds)
goes to the app, whose LoadSheddingMiddleware decides as before. A middleware that changes what a refusal
looks like (a header, a log field) must be mirrored here: tests/test_door.py compares the two answers. The door
reads a header the way the app does, through the same function (the API key: api_key_matches, which refuses a
repeated Authorization header), so a request cannot pass one check and fail the other.

A place reserved here is given back by the protocol when the request's ASGI cycle ends, whatever answered it
(server/admission.py: release_ticket), never by the code that happened to answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedserve.engine import QueueFullError
from pagedserve.server.admission import AdmissionTicket, put_ticket
from pagedserve.server.context import ServingContext
from pagedserve.server.errors import to_api_error
from pagedserve.server.middleware import GENERATION_PATHS, REQUEST_ID_HEADER, api_key_matches, valid_request_id
from pagedserve.server.request_log import RequestRecord

_REQUEST_ID = REQUEST_ID_HEADER.lower().encode()
Headers = list[tuple[bytes, bytes]]  # as the protocol parsed them: names in lower case


@dataclass(frozen=True)
class Refusal:
    """An answer given at the door: the protocol writes it with its own default headers (date, server)."""

    status: int
    headers: Headers
    body: bytes


class Door:
    """Admits (reserving a queue place) or refuses generation requests by their method, path and headers."""

    def __init__(self, serving: ServingContext) -> None:
        self.serving = serving
        settings = serving.settings
        self._api_key = settings.api_key.encode() if settings.api_key else None
        self._cors = bool(settings.cors_allowed_origins)

    def admit(self, method: str, path: str, full_path: str, headers: Headers, state: dict[str, Any]) -> Refusal | None:
        """None lets the app answer (with a place reserved in `state`'s ticket when one was free); a Refusal is the
        answer, already logged and counted. `path` is what the routes match, `full_path` the request's own
        (behind --root-path, the root path in front)."""
        if method != "POST" or path not in GENERATION_PATHS or self.serving.draining:
            return None
        if self._cors and any(name == b"origin" for name, _ in headers):
            return None
        if self._api_key is not None and not api_key_matches(headers, self._api_key):
            return None  # the app's ApiKeyMiddleware answers 401, from the same reading
        try:
            reservation = self.serving.engine.reserve_place()
        except QueueFullError as exc:
            return self._refuse(exc, path, full_path, _first(headers, _REQUEST_ID))
        if reservation is not None:
            put_ticket(state, AdmissionTicket(reservation))
        return None

    def _refuse(self, exc: QueueFullError, path: str, full_path: str, incoming_id: bytes) -> Refusal:
        request_id = valid_request_id(incoming_id.decode("latin-1"))
        error = to_api_error(exc, "prompt")
        record = RequestRecord(request_id, "POST", full_path)
        record.status, record.error_code = error.status_code, error.code
        self.serving.metrics.observe_http(path, "POST", error.status_code)
        record.log()
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(name.lower().encode(), value.encode()) for name, value in (error.headers or {}).items()]
        headers.append((_REQUEST_ID, request_id.encode()))
        return Refusal(error.status_code, headers, body)


def _first(headers: Headers, name: bytes) -> bytes:
    """A header's first value, as the app's Starlette Headers.get reads it; empty when it is absent."""
    return next((value for named, value in headers if named == name), b"")
