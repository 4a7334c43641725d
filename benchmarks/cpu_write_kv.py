"""Writing a step's new keys and values into the paged cache on the CPU: the C copy against index_copy_.

SmolLM2-135M's shape (30 layers, 3 KV heads of 64), block size 16, float32. Keys and values are the strided
views the engine hands over: slices of the fused qkv projection, feature-major for a decode batch (the layout
the CPU backend's linear returns for up to 256 tokens), token-major for a prefill chunk. Slots are laid out as
the block manager hands them out, in a cache of 2,048 blocks per layer: a decode token goes to its own
sequence's block, a prefill chunk fills whole blocks, and the blocks are scattered at random. For each case it
prints the median time of one step's writes over all 30 layers on each path and torch/native (above 1: the C
copy is faster).

    python -m benchmarks.cpu_write_kv
"""

from __future__ import annotations

import torch

from benchmarks.kernels import cpu_median_ms
from pagedserve.kernels.cpu_backend import CpuBackend

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE = 30, 2048, 16
Q_SIZE, NUM_KV_HEADS, HEAD_DIM = 576, 3, 64
KV_SIZE = NUM_KV_HEADS * HEAD_DIM
CASES = (("decode batch, feature-major", 64, True), ("prefill chunk, token-major", 2048, False))
REPEATS = 10


def layer_inputs(tokens: int, feature_major: bool) -> tuple[torch.Tensor, ...]:
    """(key, value) [tokens, KV heads, head_dim]: views into one qkv projection output."""
    width = Q_SIZE + 2 * KV_SIZE
    qkv = torch.randn(width, tokens).t() if feature_major else torch.randn(tokens, width)
    _, key, value = qkv.split([Q_SIZE, KV_SIZE, KV_SIZE], dim=-1)
    return key.view(-1, NUM_KV_HEADS, HEAD_DIM), value.view(-1, NUM_KV_HEADS, HEAD_DIM)


def step_slots(tokens: int, decode: bool) -> torch.Tensor:
    """A decode batch's slots (one token per sequence, each at some offset of its own block) or a prefill
    chunk's (consecutive tokens filling whole blocks)."""
    if decode:
        blocks = torch.randperm(NUM_BLOCKS)[:tokens]
        return blocks * BLOCK_SIZE + torch.randint(BLOCK_SIZE, (tokens,))
    blocks = torch.randperm(NUM_BLOCKS)[: -(-tokens // BLOCK_SIZE)]
    return (blocks.unsqueeze(1) * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[:tokens]


def main() -> None:
    native, torch_path = CpuBackend(), CpuBackend(native=False)
    if native.native_write_kv is None:
        raise SystemExit("the native kernels could not be built (no C compiler?)")
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [(torch.zeros(cache_shape), torch.zeros(cache_shape)) for _ in range(NUM_LAYERS)]
    print(f"{torch.get_num_threads()} threads, {NUM_LAYERS} layers per step")
    print("| case | tokens | torch ms | native ms | torch/native |")
    print("|---|---:|---:|---:|---:|")
    for name, tokens, feature_major in CASES:
        slots = step_slots(tokens, feature_major)
        inputs = [layer_inputs(tokens, feature_major) for _ in range(NUM_LAYERS)]

        def step(backend: CpuBackend, inputs: list[tuple[torch.Tensor, ...]] = inputs, slots=slots) -> None:
            for (key, value), (k_cache, v_cache) in zip(inputs, caches):
                backend.write_kv(key, value, k_cache, v_cache, slots)

        torch_ms = cpu_median_ms(lambda: step(torch_path), REPEATS)
        native_ms = cpu_median_ms(lambda: step(native), REPEATS)
        print(f"| {name} | {tokens} | {torch_ms:.2f} | {native_ms:.2f} | {torch_ms / native_ms:.2f} |")


if __name__ == "__main__":
    main()
