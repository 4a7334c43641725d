"""pagedserve's engine: everything that turns requests into tokens. Knows nothing about HTTP."""

from pagedserve.engine import openmp_policy  # noqa: F401  (first: it sets torch's OpenMP wait policy before torch loads)
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.async_stream import EngineUnavailableError
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.outputs import CompletionOutput, RequestOutput, SequenceDelta, TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduler import QueueFullError
from pagedserve.engine.structured_output import StructuredOutput
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
