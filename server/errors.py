"""OpenAI error JSON for every failure: {"error": {"message", "type", "param", "code"}}.

Overload and time limits (each one frees the request's KV blocks): a full queue is 503 `queue_full`; a request
still unscheduled after --max-queue-time is 503 `queue_timeout`, both with Retry-After; one still unscheduled
after its own `timeout` is 408 `timeout`; a generation past --request-timeout is aborted, 504 `request_timeout`.
Once a stream has started, each of these comes as its final error event instead.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine import ContextLengthError, QueueFullError, SamplingParams
from pagedserve.engine.client.async_stream import EngineUnavailableError, QueueTimeoutError, RequestTimeoutError

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = "1"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for it: nobody reads it, but access logs and metrics show it

# pydantic error types -> OpenAI-style codes; our own PydanticCustomError types pass through unchanged.
_VALIDATION_CODES = {
    "missing": "missing_required_parameter",
    "json_invalid": "invalid_json",
    "too_short": "empty_array",
    "literal_error": "invalid_value",
    "value_error": "invalid_value",
    "greater_than": "invalid_value",
    "greater_than_equal": "invalid_value",
    "less_than": "invalid_value",
    "less_than_equal": "invalid_value",
    "finite_number": "invalid_value",
    "too_long": "invalid_value",
}
_HTTP_CODES = {
    400: "invalid_request_body",  # FastAPI could not read the body (e.g. not UTF-8)
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}
_FIELD_AT_START = re.compile(r"^([a-z_]+) ")
# Fields the engine's messages may start with: the sampling parameters, and the chat template's switches.
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | {"chat_template_kwargs"}


class FieldError(ValueError):
    """A request field's value is wrong in a way only the server sees (its shape, not its range): names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready (its requests are aborted)."""


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.code = code
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}
        return {"error": error}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def invalid_request(message: str, code: str, param: str | None = None) -> APIError:
    return APIError(400, message, code=code, param=param)


def server_error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> APIError:
    return APIError(status, message, error_type="server_error", code=code, headers=headers)


def engine_unavailable(exc: EngineUnavailableError) -> APIError:
    return server_error(503, str(exc), "engine_unavailable", _retry_after())


def to_api_error(exc: ValueError | QueueFullError | EngineUnavailableError, prompt_param: str) -> APIError:
    """Maps what building SamplingParams or AsyncEngine.generate raises to the HTTP answer."""
    if isinstance(exc, ContextLengthError):
        return invalid_request(str(exc), "context_length_exceeded", prompt_param)
    if isinstance(exc, QueueFullError):
        message = f"the server is overloaded ({exc}); retry later"
        return server_error(503, message, "queue_full", _retry_after())
    if isinstance(exc, EngineUnavailableError):
        return engine_unavailable(exc)
    if isinstance(exc, FieldError):
        return invalid_request(str(exc), "invalid_value", exc.param)
    return invalid_request(str(exc), "invalid_value", _param_named_in(str(exc), prompt_param))


def as_api_error(exc: Exception) -> APIError:
    """Any failure while generating (an SSE stream's, or a whole answer's), as the error to report."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineUnavailableError):
        return engine_unavailable(exc)
    if isinstance(exc, QueueTimeoutError) and exc.requested:
        return APIError(408, f"{exc} timeout: it was aborted", code="timeout", param="timeout")
    if isinstance(exc, QueueTimeoutError):
        return server_error(503, f"{exc}: the server is overloaded; retry later", "queue_timeout", _retry_after())
    if isinstance(exc, RequestTimeoutError):
        return server_error(504, f"{exc}: it was aborted", "request_timeout")
    logger.error("generation failed", exc_info=exc)
    return internal_error()


def internal_error() -> APIError:
    """What a client sees of a bug: no detail (it is in the log, under the request's id)."""
    return server_error(500, "internal server error", "internal_error")


def _param_named_in(message: str, prompt_param: str) -> str | None:
    """Engine messages name the offending field first ("temperature must be in [0, 2], got 3")."""
    match = _FIELD_AT_START.match(message)
    if match and match.group(1) in _SAMPLING_FIELDS:
        return match.group(1)
    return prompt_param if "prompt" in message else None


def _retry_after() -> dict[str, str]:
    return {"Retry-After": RETRY_AFTER_SECONDS}


def from_validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 becomes OpenAI's 400, naming the first bad field."""
    error = exc.errors()[0]
    kind = error["type"]
    code = _VALIDATION_CODES.get(kind) or ("invalid_type" if kind.endswith(("_type", "_parsing")) else kind)
    if kind == "json_invalid":
        return invalid_request("the request body is not valid JSON", code)
    location = [str(part) for part in error["loc"] if part != "body"]
    named = error.get("ctx", {}).get("param")
    if not location and isinstance(named, str):  # a check of the whole body that names its field
        return invalid_request(error["msg"], code, named)
    if not location:
        return invalid_request(f"the request body must be a JSON object: {error['msg']}", code)
    param = ".".join(location)
    cause = error.get("ctx", {}).get("error")
    message = str(cause) if isinstance(cause, Exception) else error["msg"]
    return invalid_request(f"{param}: {message}", code, param)


def install_error_handlers(app: FastAPI) -> None:
    """Known failures only: anything else is answered 500 by RequestContextMiddleware, inside the request's
    context (its X-Request-Id, its request-log line) and without closing the connection."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(request, from_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        headers = dict(exc.headers) if exc.headers else None
        return _answer(
            request, APIError(exc.status_code, message, code=_HTTP_CODES.get(exc.status_code), headers=headers)
        )

    @app.exception_handler(EngineUnavailableError)
    @app.exception_handler(QueueTimeoutError)
    @app.exception_handler(RequestTimeoutError)
    async def engine_error(request: Request, exc: Exception) -> JSONResponse:  # raised by a whole answer's stream
        return _answer(request, as_api_error(exc))

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, exc: ClientDisconnected) -> Response:
        logger.debug("request %s: the client hung up; its generation was aborted", request.state.request_id)
        request.state.record.error_code = "client_closed"
        return Response(status_code=CLIENT_CLOSED_REQUEST)


def _answer(request: Request, error: APIError) -> JSONResponse:
    record = getattr(request.state, "record", None)  # the request log's entry (RequestContextMiddleware)
    if record is not None:
        record.error_code = error.code
    return error.response()
