"""A draft model for speculative decoding: a second model loaded beside the target, with a paged KV cache of
its own (its own blocks, shaped by the draft's layers and heads), run by a ModelRunner of its own.

The proposer (engine/speculative/draft.py) keeps the draft's block tables; this side only loads the model,
checks that it speaks the target's vocabulary, and allocates its cache.
"""

from __future__ import annotations

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.batch import BlockTables
from pagedserve.engine.worker.kernel_layouts import use_activations
from pagedserve.engine.worker.kv_caches import allocate_kv_caches
from pagedserve.engine.worker.loaded_model import LoadedModel
from pagedserve.engine.worker.model_loader import load_model
from pagedserve.engine.worker.model_runner import ModelRunner


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft's token ids must mean the target's tokens, or its proposals are noise (refused at start-up)."""
    target_vocab, draft_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differ = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
        raise ValueError(
            f"draft model {draft.model_dir} does not share the target's tokenizer vocabulary "
            f"({len(draft_vocab)} tokens vs the target's {len(target_vocab)}, {differ} entries differ): "
            "a draft must use the target's tokenizer"
        )


def load_draft_runner(
    config: EngineConfig, target: LoadedModel, block_tables: BlockTables, num_blocks: int
) -> tuple[LoadedModel, ModelRunner]:
    """The draft model named by config.draft_model, loaded as the target was (device, dtype, formats), whole on
    this rank, with `num_blocks` blocks of KV cache that `block_tables` hands out."""
    assert config.draft_model is not None
    draft = load_model(config.replace(model=config.draft_model, tokenizer=None, tensor_parallel_size=1))
    check_same_vocabulary(target, draft)
    # The target verifies k + 1 rows with the activations plain decoding's step would have (the step's proposed
    # rows aside: kernels/quantized.py), and the draft decodes a token a step: with the target's activations it
    # proposes what the verification computes (the target as its own draft: every proposal accepted).
    use_activations(draft, config.activation_dtype)
    caches = allocate_kv_caches(draft.rank_spec, num_blocks, block_tables.block_size, draft.dtype, draft.device)
    return draft, ModelRunner(draft.model, draft.backend, block_tables, caches, draft.device)
