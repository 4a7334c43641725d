"""Model implementations, picked by the checkpoint's `architectures`."""

from pagedserve.engine.worker.models.llama import KVCache, LlamaForCausalLM
from pagedserve.engine.worker.models.phi3 import Phi3ForCausalLM
from pagedserve.engine.worker.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec

# The class of each architecture whose layers differ from Llama's in more than the spec says.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {"Phi3ForCausalLM": Phi3ForCausalLM}


def model_class(spec: ModelSpec) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES.get(spec.architecture, LlamaForCausalLM)


__all__ = ["SUPPORTED_ARCHITECTURES", "KVCache", "LlamaForCausalLM", "ModelSpec", "model_class"]
