"""pagedserve's engine: everything that turns requests into tokens. Knows nothing about HTTP."""

from pagedserve.engine import openmp_policy  # noqa: F401  (first: it sets torch's OpenMP wait policy before torch loads)
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.client.async_stream import EngineUnavailableError
from pagedserve.engine.client.llm import LLM
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.outputs import CompletionOutput, RequestOutput, SequenceDelta, TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams, StructuredOutput
from pagedserve.engine.scheduling.scheduler import QueueFullError
from pagedserve.engine.validation import ContextLengthError, RequestLimits

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
