"""pagedserve's engine: everything that turns requests into tokens. Knows nothing about HTTP."""

import os

# OpenMP workers that spin while they wait take the core from the thread doing the work whenever anything
# else runs (the HTTP thread, a tokenizer, another process): decode-sized matmuls then slow down up to 10x.
# Sleeping has a price too, a wake-up per parallel region, which a host the engine has to itself can avoid
# with a short spin (GOMP_SPINCOUNT; see benchmarks/omp_wait.py and the README). OpenMP reads these once,
# when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
