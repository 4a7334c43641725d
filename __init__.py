"""pagedserve: an OpenAI-compatible LLM serving engine with a paged KV cache and continuous batching.

The checkout's root is the package: engine/, server/ and kernels/ install as pagedserve.engine,
pagedserve.server and pagedserve.kernels. The offline API is here:

    from pagedserve import LLM, SamplingParams
    outputs = LLM().generate(["The capital of France is"], SamplingParams(max_tokens=16))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.engine import (
        LLM,
        AsyncEngine,
        CompletionOutput,
        ContextLengthError,
        EngineConfig,
        EngineUnavailableError,
        QueueFullError,
        RequestOutput,
        SamplingParams,
    )

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "ContextLengthError",
    "EngineConfig",
    "EngineUnavailableError",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    """The engine's names, loaded on first use (the engine's face loads each from its module)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("pagedserve.engine"), name)
