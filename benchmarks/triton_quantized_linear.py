"""The Triton dequant-GEMM (kernels/triton_quantized_linear.py) against torch's bfloat16 matmul, on one GPU.

Llama-3-8B's projections as the engine fuses them (qkv, o, gate_up, down), at decode (1-32 tokens) and prefill
(512, 2048 tokens), bfloat16 activations. For each format it prints microseconds per call of the kernel and of
F.linear with the dequantized bfloat16 weight, their ratio ("bf16/kernel" above 1: the kernel is faster), the
weight bytes per second the kernel reaches, and its largest error against the bfloat16 matmul. Each timed call
cycles through enough copies of the weight that every one is read from memory, not from L2, as in a real step.
`--sweep` also times alternative tile shapes and prints the best next to choose_tiles' pick.

    python -m benchmarks.triton_quantized_linear [--formats q4_k,q6_k] [--tokens 1,8,512] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Iterable
from functools import partial

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from pagedserve.kernels.device_blocks import pack_for_device
from pagedserve.kernels.quantized_reference import dequantize, quantize
from pagedserve.kernels.triton_quantized_linear import (
    DECODE_ROWS,
    GemmTiles,
    choose_tiles,
    device_sm_count,
    quantized_linear,
)

# (projection, out, in) of one Llama-3-8B layer, q/k/v and gate/up fused as the engine fuses them
PROJECTIONS = (
    ("qkv_proj", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("gate_up_proj", 28672, 4096),
    ("down_proj", 4096, 14336),
)
TOKENS = (1, 8, 32, 512, 2048)
FORMATS = ("q4_k", "q6_k", "q8_0", "q4_0")
COPY_BYTES = 512 << 20  # the weight copies one timed call cycles through: well past the L2 cache


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/triton_quantized_linear.py times a CUDA kernel: it needs a CUDA device, none found")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--sweep", action="store_true", help="also time alternative tiles and print the best")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"{torch.cuda.get_device_name()}; bfloat16 activations; microseconds per call (median)")
    print(
        f"{'format':7} {'projection':13} {'tokens':>6} {'kernel':>9} {'bf16':>9} {'bf16/kernel':>11} "
        f"{'weight GB/s':>11} {'max err':>8}  tiles" + ("  | best swept tiles (us)" if args.sweep else "")
    )
    for qtype in args.formats.split(","):
        for name, out_features, in_features in PROJECTIONS:
            for row in _rows(qtype, out_features, in_features, tokens, args.sweep):
                print(f"{qtype:7} {name:13} {row}")


def _rows(qtype: str, out_features: int, in_features: int, token_counts: list[int], sweep: bool) -> Iterable[str]:
    weight = quantize(torch.randn(out_features, in_features) * 0.02, qtype)
    packed = pack_for_device(weight, "cuda")
    dense = dequantize(weight).to("cuda", torch.bfloat16)
    packed_copies = [packed] + [pack_for_device(weight, "cuda") for _ in range(_copies(packed.nbytes) - 1)]
    dense_copies = [dense] + [dense.clone() for _ in range(_copies(dense.numel() * 2) - 1)]
    for tokens in token_counts:
        x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
        tiles = choose_tiles(tokens, out_features, in_features, device_sm_count(x.device))
        error = (quantized_linear(x, packed).float() - F.linear(x, dense).float()).abs().max().item()
        kernel_us = _us_per_call([partial(quantized_linear, x, w) for w in packed_copies])
        dense_us = _us_per_call([partial(F.linear, x, w) for w in dense_copies])
        row = (
            f"{tokens:6} {kernel_us:9.1f} {dense_us:9.1f} {dense_us / kernel_us:11.2f} "
            f"{packed.nbytes / kernel_us / 1e3:11.0f} {error:8.4f}  {_describe(tiles)}"
        )
        if sweep:
            timed = [
                (_us_per_call([partial(quantized_linear, x, w, tiles=t) for w in packed_copies]), t)
                for t in _candidates(tokens, in_features)
            ]
            best_us, best = min(timed, key=lambda pair: pair[0])
            row += f"  | {_describe(best)} ({best_us:.1f})"
        yield row
    del packed_copies, dense_copies
    torch.cuda.empty_cache()


def _copies(nbytes: int) -> int:
    return max(2, min(64, -(-COPY_BYTES // nbytes)))


def _us_per_call(calls: list[Callable[[], object]]) -> float:
    """Median microseconds of one call, replaying all `calls` (one per weight copy) in a CUDA graph."""

    def run_all() -> None:
        for call in calls:
            call()

    run_all()  # compiles the kernel before the graph records it
    return 1000 * do_bench_cudagraph(run_all, rep=200, return_mode="median") / len(calls)


def _candidates(tokens: int, in_features: int) -> list[GemmTiles]:
    """Tile shapes to sweep: small-M shapes with split-K for decode, larger ones without for prefill."""
    if tokens <= DECODE_ROWS:
        shapes = itertools.product([32, 64, 128], [128, 256], [1, 2, 4, 8], [3, 4])
        tiles = [GemmTiles(DECODE_ROWS, n, k, split, 4, stages) for n, k, split, stages in shapes]
    else:
        shapes = itertools.product([(64, 64), (64, 128), (128, 64), (128, 128)], [64, 128], [4, 8], [2, 3, 4])
        tiles = [GemmTiles(m, n, k, 1, warps, stages) for (m, n), k, warps, stages in shapes]
    return [t for t in tiles if in_features % t.block_k == 0]


def _describe(tiles: GemmTiles) -> str:
    shape = f"{tiles.block_m}x{tiles.block_n}x{tiles.block_k}"
    return f"{shape} split {tiles.split_k} w{tiles.num_warps} s{tiles.num_stages}"


if __name__ == "__main__":
    main()
