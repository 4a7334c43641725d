"""Decode paged attention on the CPU: the native kernel against the torch path (gather + SDPA).

SmolLM2-135M's shape (30 layers of 9 query heads, 3 KV heads, head_dim 64), block size 16, float32, each
sequence's blocks scattered at random. A decode step's attention is timed over all 30 layers, each with its own
cache as in the engine, so the caches are read from memory and not from a warm CPU cache. For each batch and
context it prints the median time of that step's attention on each path, the K/V bytes it must read, the
bandwidth the native kernel reaches and its share of this machine's read bandwidth (a torch sum over 200 MB),
and torch/native (above 1: the kernel is faster).

    python -m benchmarks.cpu_decode_attention
"""

from __future__ import annotations

import sys

import torch

from benchmarks.kernels import DecodeShape, cpu_median_ms, decode_metadata, paged_decode_inputs
from pagedserve.kernels.cpu_backend import CpuBackend

SMOLLM2 = DecodeShape(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32, device="cpu")
SCALE = SMOLLM2.head_dim**-0.5
BATCH_SIZES = (16, 64)
CONTEXT_LENS = (256, 512)
NUM_LAYERS = 30
REPEATS = 10


def read_bandwidth_gbps() -> float:
    data = torch.randn(50_000_000)
    return data.numel() * data.element_size() / cpu_median_ms(data.sum, REPEATS) / 1e6


def step_ms(backend: CpuBackend, batch: int, context: int, layers: list[tuple[torch.Tensor, ...]]) -> float:
    """Every layer's decode attention for one step, planned once as the engine plans it."""
    metadata = backend.prepare(decode_metadata(batch, context, layers[0][3], SMOLLM2.block_size))

    def step() -> None:
        for query, k_cache, v_cache, _ in layers:
            backend.paged_attention(query, k_cache, v_cache, metadata, SCALE)

    return cpu_median_ms(step, REPEATS)


def main() -> int:
    native, torch_path = CpuBackend(), CpuBackend(native=False)
    if native.native_decode is None:
        print("the native kernel could not be built here (see the warning above): nothing to compare")
        return 1
    read_gbps = read_bandwidth_gbps()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, read bandwidth {read_gbps:.1f} GB/s")
    print(f"decode attention over {NUM_LAYERS} layers, ms per step:")
    print(f"{'batch':>5} {'context':>7} {'kv_MB':>7} {'torch_ms':>9} {'native_ms':>9} {'GB/s':>6} {'%read':>6} ratio")
    for batch in BATCH_SIZES:
        for context in CONTEXT_LENS:
            # One block table for all layers, as in the engine; each layer its own cache.
            first = paged_decode_inputs(batch, context, SMOLLM2)
            layers = [first] + [
                (*paged_decode_inputs(batch, context, SMOLLM2)[:3], first[3]) for _ in range(NUM_LAYERS - 1)
            ]
            torch_ms, native_ms = (step_ms(backend, batch, context, layers) for backend in (torch_path, native))
            kv_bytes = NUM_LAYERS * 2 * first[1].numel() * first[1].element_size()
            gbps = kv_bytes / native_ms / 1e6
            print(
                f"{batch:>5} {context:>7} {kv_bytes / 1e6:>7.1f} {torch_ms:>9.2f} {native_ms:>9.2f} "
                f"{gbps:>6.1f} {gbps / read_gbps:>6.0%} {torch_ms / native_ms:>5.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
