"""What every route shares: the settings, and the serving context built once per app."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import time
import uuid
from dataclasses import dataclass, field
from importlib.metadata import version

from fastapi import Request

from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.client.async_stream import EngineUnavailableError
from pagedserve.engine.config import EMBEDDED_NAME
from pagedserve.server.errors import APIError, engine_unavailable
from pagedserve.server.logprobs import TokenText
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.protocol import Envelope
from pagedserve.server.reasoning import THINK_PARSERS, reasoning_parser_for_template
from pagedserve.server.tool_parsers import parser_for_template

VERSION = version("pagedserve")


@dataclass
class ServerSettings:
    served_model_names: list[str] = field(default_factory=lambda: [EMBEDDED_NAME])  # the first is reported
    api_key: str | None = None
    cors_allowed_origins: list[str] = field(default_factory=list)
    max_request_bytes: int = 1 << 20  # larger bodies get 413
    tool_call_parser: str = "auto"  # how `tool_choice: auto` replies are read; auto = from the chat template
    # "think" (or "qwen3", "deepseek_r1"): <think>...</think> is reasoning_content; auto = from the template
    reasoning_parser: str = "auto"
    web_page: bool = True  # GET / serves the chat and status page (off: --disable-web-page)


class ServingContext:
    """What every route needs: the engine, the names it answers to, metrics, ids."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.model_name = settings.served_model_names[0]
        self.created = int(time.time())
        identity = f"{VERSION}:{self.model_name}".encode()
        self.system_fingerprint = "fp_" + hashlib.sha256(identity).hexdigest()[:10]
        self.draining = False  # set on shutdown, so /ready turns 503 before the listener closes
        self.in_flight = 0  # requests that arrived before draining began (RequestContextMiddleware)
        self._sequence = itertools.count()

    def check_model(self, name: str) -> None:
        if name not in self.settings.served_model_names:
            raise APIError(404, f"the model {name!r} does not exist", code="model_not_found", param="model")

    def engine_for(self, model: str | None) -> AsyncEngine:
        """The ready engine, for a request naming one of the served models (or none, where that is optional)."""
        if model is not None:
            self.check_model(model)
        return self.ready_engine()

    def ready_engine(self) -> AsyncEngine:
        if self.draining:
            raise engine_unavailable(EngineUnavailableError("the server is shutting down"))
        if not self.engine.is_ready:
            raise engine_unavailable(EngineUnavailableError(self.engine.unavailable_reason()))
        return self.engine

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until no request is in flight (True), or `timeout` seconds (False)."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.in_flight

    def envelope(self, id_prefix: str) -> Envelope:
        """A new answer's id, creation time and model, for `chatcmpl-` or `cmpl-` objects."""
        return Envelope(
            id=f"{id_prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model_name,
            system_fingerprint=self.system_fingerprint,
        )

    def engine_request_id(self, request_id: str) -> str:
        """Clients may reuse an X-Request-Id; the engine needs ids unique among running requests."""
        return f"{request_id}-{next(self._sequence)}"

    @functools.cached_property
    def tool_call_parser(self) -> str:
        """The parser for the model's tool-call format (needs the loaded engine)."""
        chosen = self.settings.tool_call_parser
        return parser_for_template(self.engine.tokenizer.chat_template) if chosen == "auto" else chosen

    @functools.cached_property
    def splits_reasoning(self) -> bool:
        """Whether replies start with reasoning in <think> tags (needs the loaded engine)."""
        chosen = self.settings.reasoning_parser
        return (
            reasoning_parser_for_template(self.engine.tokenizer.chat_template)
            if chosen == "auto"
            else chosen in THINK_PARSERS
        )

    @property
    def token_text(self) -> TokenText:
        """A token id's text, for logprobs (needs the loaded engine)."""
        return self.engine.tokenizer.token_text


def serving(request: Request) -> ServingContext:
    return request.app.state.serving
