"""pagedserve's engine: everything that turns requests into tokens. Knows nothing about HTTP."""

from engine import openmp_policy  # noqa: F401  (first: it sets torch's OpenMP wait policy before torch loads)
from engine.async_engine import AsyncEngine
from engine.async_stream import EngineUnavailableError
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import ContextLengthError, LLMEngine
from engine.outputs import CompletionOutput, RequestOutput, SequenceDelta, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.scheduler import QueueFullError

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "ContextLengthError",
    "EngineConfig",
    "EngineUnavailableError",
    "LLMEngine",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
    "SequenceDelta",
    "TokenLogprob",
]
