"""pagedserve: an OpenAI-compatible LLM serving engine with a paged KV cache and continuous batching.

The checkout's root is the package: engine/, server/ and kernels/ install as pagedserve.engine,
pagedserve.server and pagedserve.kernels. The offline API is here:

    from pagedserve import LLM, SamplingParams
    outputs = LLM().generate(["The capital of France is"], SamplingParams(max_tokens=16))
"""

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
