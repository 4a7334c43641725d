"""Model implementations, picked by the checkpoint's `architectures`."""

from engine.models.llama import KVCache, LlamaForCausalLM
from engine.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec

__all__ = ["SUPPORTED_ARCHITECTURES", "KVCache", "LlamaForCausalLM", "ModelSpec"]
