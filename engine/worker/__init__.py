"""The worker side: the model and everything that runs it (loading, weights and their formats, KV cache sizing
and profiling, the model runner, CUDA graphs, tensor-parallel ranks).

This face is the one door into the room: the engine core builds a ModelExecutor and runs each step through it;
the rest of the engine and the server name only what is listed here. Modules inside the room import each other
by their full path, never through this face.
"""

from pagedserve.engine.config import EMBEDDED_NAME
from pagedserve.engine.worker.distributed.liveness import RankLostError
from pagedserve.engine.worker.draft_model import load_draft_runner
from pagedserve.engine.worker.executor import ModelExecutor
from pagedserve.engine.worker.loaded_model import LoadedModel
from pagedserve.engine.worker.model_runner import ModelRunner
from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path, resolve_model_dir
from pagedserve.engine.worker.weights.gguf_files import dequantized_model_dir, gguf_model_dir

__all__ = [
    "EMBEDDED_NAME",
    "LoadedModel",
    "ModelExecutor",
    "ModelRunner",
    "RankLostError",
    "dequantized_model_dir",
    "embedded_gguf_path",
    "gguf_model_dir",
    "load_draft_runner",
    "resolve_model_dir",
]
