"""Model implementations, picked by the checkpoint's `architectures`."""

from pagedserve.engine.worker.models.llama import KVCache, LlamaForCausalLM
from pagedserve.engine.worker.models.moe import MOE_ARCHITECTURES, MoeForCausalLM
from pagedserve.engine.worker.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec

__all__ = ["SUPPORTED_ARCHITECTURES", "KVCache", "LlamaForCausalLM", "ModelSpec", "model_class"]


def model_class(spec: ModelSpec) -> type[LlamaForCausalLM]:
    """The implementation of `spec`'s architecture."""
    return MoeForCausalLM if spec.architecture in MOE_ARCHITECTURES else LlamaForCausalLM
