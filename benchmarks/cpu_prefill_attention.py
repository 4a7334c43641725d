"""Prefill attention on the CPU: whole prompts through the native kernel row by row, against SDPA.

The CPU backend sends the prefill chunks of sequences up to NATIVE_PREFILL_MAX_LEN tokens to the native
attention kernel, one query row at a time over the tokens up to its own; longer ones go to CPU SDPA's flash
kernel after a gather of their blocks. This prints where that limit comes from: for prompts of several
lengths (SmolLM2-135M's heads, block size 16, blocks scattered at random), the median time of one whole-prompt
prefill's attention over 30 layers on each path and sdpa/native (above 1: the native kernel is faster).

    python -m benchmarks.cpu_prefill_attention
"""

from __future__ import annotations

import sys

import torch

from benchmarks.cpu_decode_attention import NUM_LAYERS, SCALE, SMOLLM2
from benchmarks.kernels import cpu_median_ms
from pagedserve.kernels.cpu_attention import NATIVE_PREFILL_MAX_LEN
from pagedserve.kernels.cpu_backend import CpuBackend
from pagedserve.kernels.metadata import AttentionMetadata

PROMPT_LENS = (64, 205, 400, 800)
REPEATS = 5


def prefill_ms(backend: CpuBackend, prompt_len: int, native: bool) -> float:
    """One prompt's attention in every layer, planned once; `native` picks the path for this length."""
    shape = SMOLLM2
    num_blocks = -(-prompt_len // shape.block_size)
    cache_shape = (4 * num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    layers = [(torch.randn(cache_shape), torch.randn(cache_shape)) for _ in range(NUM_LAYERS)]
    query = torch.randn(prompt_len, shape.num_heads, shape.head_dim)
    metadata = AttentionMetadata.from_tensors(
        torch.randperm(4 * num_blocks)[:num_blocks].int().view(1, -1),
        torch.tensor([prompt_len], dtype=torch.int32),
        torch.tensor([0, prompt_len], dtype=torch.int32),
        shape.block_size,
    )
    plan = backend.prepare(metadata).plan
    # Route the one prompt by hand, whatever NATIVE_PREFILL_MAX_LEN says about its length.
    plan.native_prefills, plan.sdpa_prefills = (plan.prefills, []) if native else ([], plan.prefills)

    def step() -> None:
        for k_cache, v_cache in layers:
            backend.paged_attention(query, k_cache, v_cache, metadata, SCALE)

    return cpu_median_ms(step, REPEATS)


def main() -> int:
    backend = CpuBackend()
    if backend.native_decode is None:
        print("the native kernel could not be built here: nothing to compare")
        return 1
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; native up to {NATIVE_PREFILL_MAX_LEN} tokens")
    print("| prompt tokens | sdpa ms | native ms | sdpa/native |")
    print("|---:|---:|---:|---:|")
    for prompt_len in PROMPT_LENS:
        sdpa, native = prefill_ms(backend, prompt_len, False), prefill_ms(backend, prompt_len, True)
        print(f"| {prompt_len} | {sdpa:.2f} | {native:.2f} | {sdpa / native:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
