"""Model implementations, picked by the checkpoint's `architectures` (models/registry.py)."""

from pagedserve.engine.worker.models.llama import KVCache, LlamaForCausalLM
from pagedserve.engine.worker.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec

__all__ = ["SUPPORTED_ARCHITECTURES", "KVCache", "LlamaForCausalLM", "ModelSpec"]
