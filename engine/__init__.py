"""pagedserve's engine: everything that turns requests into tokens. Knows nothing about HTTP."""

import os

# torch's OpenMP workers (MKL matmuls at prefill, torch's own ops) would spin while they wait, taking the core
# from the thread doing the work whenever anything else runs (the HTTP thread, a tokenizer, another process):
# matmuls then slow down up to 10x. So they sleep; waking them costs a little on each parallel region, which
# a host the engine has to itself can trade for a spin (GOMP_SPINCOUNT; see benchmarks/omp_wait.py and the
# README). The native CPU kernels, which run most of a decode step, have their own pool that yields instead
# (kernels/csrc/parallel.c). OpenMP reads these once, when torch loads.
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
