"""x @ W^T against (W @ x^T)^T on this CPU: the choice behind CpuBackend.linear (kernels/cpu_backend.py).

    python -m benchmarks.linear_orientation [--rows 16,64,128,256,2048]

The same product, in float32 on torch's threads, for every projection of SmolLM2-135M. Prints GFLOP/s of
each orientation (best of three rounds) and their ratio; `linear` takes the transposed one up to
TRANSPOSED_GEMM_MAX_ROWS rows.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

# (name, out_features, in_features) of SmolLM2-135M's projections (hidden 576, 9 + 2 x 3 heads of 64,
# MLP 1536 fused gate/up, vocabulary 49152).
PROJECTIONS = (
    ("qkv_proj", 960, 576),
    ("o_proj", 576, 576),
    ("gate_up_proj", 3072, 576),
    ("down_proj", 576, 1536),
    ("lm_head", 49152, 576),
)


def best_ms(fn: Callable[[], torch.Tensor], repeats: int = 10, rounds: int = 3) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats * 1000)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,64,128,256,2048", help="token counts (rows of x), comma-separated")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32")
    print("| rows | projection | x @ W^T GFLOP/s | (W @ x^T)^T GFLOP/s | ratio |")
    print("|---:|---|---:|---:|---:|")
    for rows in (int(part) for part in args.rows.split(",")):
        for name, out_features, in_features in PROJECTIONS:
            x, weight = torch.randn(rows, in_features), torch.randn(out_features, in_features)
            gflop = 2 * rows * out_features * in_features / 1e9
            direct = best_ms(lambda x=x, weight=weight: x @ weight.t())
            transposed = best_ms(lambda x=x, weight=weight: torch.mm(weight, x.t()).t())
            print(
                f"| {rows} | {name} | {gflop / direct * 1e3:.0f} | {gflop / transposed * 1e3:.0f} | "
                f"{direct / transposed:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
