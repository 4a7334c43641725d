"""The FastAPI app factory."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.server.chat import handler as chat
from pagedserve.server.completions import handler as completions
from pagedserve.server.context import VERSION, ServerSettings, ServingContext
from pagedserve.server.errors import install_error_handlers
from pagedserve.server.llama_cpp import handler as llama_cpp
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.middleware import (
    OPEN_PATHS,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    LoadSheddingMiddleware,
    RequestContextMiddleware,
)
from pagedserve.server.responses import handler as responses
from pagedserve.server.service import handler as service
from pagedserve.server.tokenization import handler as tokenization
from pagedserve.server.web_page import page_paths, web_page_router


def create_app(engine: AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    """The app for an engine that may still be loading (/ready says when it is not)."""
    settings = settings or ServerSettings()
    app = FastAPI(title="pagedserve", version=VERSION, summary="OpenAI-compatible LLM serving engine")
    metrics = ServerMetrics(engine, settings.served_model_names[0])
    engine.add_observer(metrics)
    app.state.serving = ServingContext(engine, settings, metrics)
    install_error_handlers(app)
    for module in (chat, completions, responses, service, tokenization, llama_cpp):
        app.include_router(module.router)
    if settings.web_page:
        app.include_router(web_page_router())
    # Added innermost first: request ids and counts wrap everything, CORS answers preflights before auth, a full
    # queue refuses before any body is read (and a place reserved at the door is given back whatever comes
    # after), and bodies are read only for authorized clients.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(LoadSheddingMiddleware, serving=app.state.serving)
    if settings.api_key:
        open_paths = OPEN_PATHS | page_paths() if settings.web_page else OPEN_PATHS  # the page asks for the key
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, open_paths=open_paths)
    if settings.cors_allowed_origins:
        origins = settings.cors_allowed_origins
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(RequestContextMiddleware, serving=app.state.serving)
    return app
