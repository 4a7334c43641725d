"""pagedserve's engine: everything that turns requests into tokens. Knows nothing about HTTP."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagedserve.engine import openmp_policy  # noqa: F401  (first: it sets torch's OpenMP wait policy before torch loads)

if TYPE_CHECKING:
    from pagedserve.engine.client.async_engine import AsyncEngine
    from pagedserve.engine.client.async_stream import EngineUnavailableError
    from pagedserve.engine.client.llm import LLM
    from pagedserve.engine.config import EngineConfig
    from pagedserve.engine.core.llm_engine import LLMEngine
    from pagedserve.engine.outputs import CompletionOutput, RequestOutput, SequenceDelta, TokenLogprob
    from pagedserve.engine.sampling_params import SamplingParams, StructuredOutput
    from pagedserve.engine.validation import ContextLengthError, QueueFullError, RequestLimits

# The names load on first use: `pagedserve serve` starts the engine core before this process imports torch.
_HOMES = {
    "AsyncEngine": "pagedserve.engine.client.async_engine",
    "EngineUnavailableError": "pagedserve.engine.client.async_stream",
    "LLM": "pagedserve.engine.client.llm",
    "EngineConfig": "pagedserve.engine.config",
    "LLMEngine": "pagedserve.engine.core.llm_engine",
    "CompletionOutput": "pagedserve.engine.outputs",
    "RequestOutput": "pagedserve.engine.outputs",
    "SequenceDelta": "pagedserve.engine.outputs",
    "TokenLogprob": "pagedserve.engine.outputs",
    "SamplingParams": "pagedserve.engine.sampling_params",
    "StructuredOutput": "pagedserve.engine.sampling_params",
    "QueueFullError": "pagedserve.engine.validation",
    "ContextLengthError": "pagedserve.engine.validation",
    "RequestLimits": "pagedserve.engine.validation",
}

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "ContextLengthError",
    "EngineConfig",
    "EngineUnavailableError",
    "LLMEngine",
    "QueueFullError",
    "RequestLimits",
    "RequestOutput",
    "SamplingParams",
    "SequenceDelta",
    "StructuredOutput",
    "TokenLogprob",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # once: later lookups find it without calling here
    return value
