"""pagedserve's HTTP front end: OpenAI protocol, streaming, auth, errors, Prometheus export, CLI."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.server.app import create_app
    from pagedserve.server.context import ServerSettings

# Loaded on first use: the CLI starts the engine core before it imports the app (FastAPI, the engine's client).
_HOMES = {"create_app": "pagedserve.server.app", "ServerSettings": "pagedserve.server.context"}

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
