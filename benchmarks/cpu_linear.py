"""A decode step's projections on the CPU: the skinny linear kernel against torch's matmul (MKL).

SmolLM2-135M's shapes (30 layers of qkv 576->960, o 576->576, gate/up 576->3072, down 1536->576, and the
576->49152 LM head once), float32, each layer with its own weights so that they come from memory as in the
engine. For each batch size it prints the median time of one step's projections on each path, the GFLOP/s
they reach, and torch/kernel (above 1: the kernel is faster). Batch sizes outside the kernel's range
(kernels/cpu_linear.py) are printed too: they show where that range comes from.

    python -m benchmarks.cpu_linear
"""

from __future__ import annotations

import torch

from benchmarks.kernels import cpu_median_ms
from pagedserve.kernels.cpu_linear import MAX_ROWS, MIN_ROWS, skinny_linear_kernel

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of each projection
LM_HEAD = (49152, 576)
NUM_LAYERS = 30
BATCH_SIZES = (1, 4, 8, 16, 20, 32, 48, 64, 96, 128, 192)
REPEATS = 5


def step_weights() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) for _ in range(NUM_LAYERS) for shape in LAYER_SHAPES]
    return [*weights, torch.randn(LM_HEAD, generator=generator)]


def main() -> None:
    kernel = skinny_linear_kernel()
    if kernel is None:
        raise SystemExit("the skinny linear kernel could not be built (no C compiler?)")
    weights = step_weights()
    flop_per_token = 2 * sum(w.numel() for w in weights)
    print(f"{torch.get_num_threads()} threads; the engine uses the kernel for {MIN_ROWS}-{MAX_ROWS} tokens")
    print("| tokens | torch ms | kernel ms | torch GFLOP/s | kernel GFLOP/s | torch/kernel |")
    print("|---:|---:|---:|---:|---:|---:|")
    for tokens in BATCH_SIZES:
        # feature-major, as the layers pass activations
        inputs = {width: torch.randn(width, tokens).t() for width in {w.shape[1] for w in weights}}
        pairs = [(inputs[w.shape[1]], w) for w in weights]
        torch_ms = cpu_median_ms(lambda pairs=pairs: [torch.mm(w, x.t()) for x, w in pairs], REPEATS)
        kernel_ms = cpu_median_ms(lambda pairs=pairs: [kernel(x, w, None) for x, w in pairs], REPEATS)
        gflop = flop_per_token * tokens / 1e9
        print(
            f"| {tokens} | {torch_ms:.1f} | {kernel_ms:.1f} | {gflop / torch_ms * 1000:.0f} | "
            f"{gflop / kernel_ms * 1000:.0f} | {torch_ms / kernel_ms:.2f} |"
        )


if __name__ == "__main__":
    main()
