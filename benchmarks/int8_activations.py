"""Block-format products with float32 against 8- and 16-bit activations (kernels/quantized.py's activation_dtype),
per format, at a 1B-parameter Llama's shapes, with the machine's copy bandwidth measured in the same run.

Each format's weights are four decoder layers of Llama-3.2-1B's shape (hidden 2048, 8 KV heads of 64, FFN
8192: q/k/v fused 3072 x 2048, o 2048 x 2048, gate/up fused 16384 x 2048, down 2048 x 8192), in memory of their
own (132-250 MiB: far past the last-level cache, so every product streams its weight from memory as a decode
step does). The paths alternate (float32, int8, int16, float32, ...) so that a shared machine's slow moments hit
both; the figure is the weights' bytes over the median time of one pass over the four layers. Token counts 1
(one stream's decode step) and up: kernels/quantized.py's INTEGER_MAX_TOKENS is where each integer kernel stops
being faster. The kernels are called directly, at every token count.

Copy bandwidth: a 256 MiB torch copy on the same threads, as bytes read per second (what a weight stream is;
a copy also writes as many).

Where the CPU has AMX's tile unit (csrc/amx_tiles.c), int16 runs twice: on the vector unit alone ("int16") and,
for Q8_0, Q4_0 and Q4_1 from two tokens, on the tile unit ("int16 AMX", what the engine runs there). Elsewhere,
where the AVX2 kernels are built, Q4_0 and Q4_K run twice too: as the file lays them out ("int16") and with their
rows interleaved eight at a time ("int16 r8", kernels/interleaved_rows.py: what the engine runs there).

--cached: the kernels' arithmetic alone, as a busy machine still measures it: one thread, a 1024 x 2048 weight
that stays in cache, the thread's CPU time (not the wall clock) per 32 weights and token, best of a few rounds.

    python -m benchmarks.int8_activations [--tokens 1,4,8] [--formats q4_0,q8_0] [--cached]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the engine sets it (engine/openmp_policy.py)

import torch

from benchmarks.quantized_linear import cpu_model
from pagedserve.kernels.cpu_native import native_function
from pagedserve.kernels.interleaved_rows import INTERLEAVED as LAYOUTS
from pagedserve.kernels.interleaved_rows import interleave_rows, rows8_kernel_built
from pagedserve.kernels.quantized import (
    QuantizedLinear,
    QuantizedWeight,
    allow_tile_unit,
    int8_linear_kernel,
    quantize,
    quantized_linear_kernel,
    tile_unit_takes,
)

LAYER = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))
NUM_LAYERS = 4
FORMATS = ("q4_0", "q8_0", "q4_1", "q4_k", "q5_k", "q6_k")
TOKENS = (1, 2, 3, 4, 8, 15)
SAMPLES = 9
COPY_BYTES = 256 << 20
ROWS_CACHED = 1024  # x 2048: 1.1-1.7 MiB of blocks, in a Zen 4 core's 2 MiB L2
KERNEL_PATHS = {0: "portable C", 1: "AVX2", 2: "AVX-512 VNNI"}
INTERLEAVED = "int16 r8"


def layers_of(qtype: str) -> list[QuantizedWeight]:
    """NUM_LAYERS layers of `qtype` weights: 256 quantized rows of each width, repeated to each shape's rows
    (the contents do not change the time, only the bytes do)."""
    generator = torch.Generator().manual_seed(0)
    rows = {k: quantize(torch.randn(256, k, generator=generator) * 0.02, qtype) for k in {k for _, k in LAYER}}
    weights = []
    for _ in range(NUM_LAYERS):
        for out_features, in_features in LAYER:
            blocks = rows[in_features].blocks.repeat(out_features // 256, 1)
            weights.append(QuantizedWeight(qtype, blocks, (out_features, in_features)))
    return weights


def kernel_of(path: str) -> QuantizedLinear:
    """The kernel of one of PATHS itself, at any token count (quantized_linear takes the integer ones below
    INTEGER_MAX_TOKENS), the tile unit allowed for "int16 AMX" alone."""
    kernel = quantized_linear_kernel() if path == "float32" else int8_linear_kernel(path != "int8")
    assert kernel is not None
    allow_tile_unit(path == "int16 AMX")
    return kernel


def laid_out(weights: list[QuantizedWeight], path: str) -> list[QuantizedWeight]:
    """The weights as `path` reads them: interleaved for "int16 r8", else as stored."""
    return [interleave_rows(w) for w in weights] if path == INTERLEAVED else weights


def pass_seconds(weights: list[QuantizedWeight], x: dict[int, torch.Tensor], path: str) -> float:
    kernel = kernel_of(path)
    outs = {w.shape: torch.empty(x[w.shape[1]].shape[0], w.shape[0]) for w in weights}
    start = time.perf_counter()
    for weight in weights:
        kernel(x[weight.shape[1]], weight, None, outs[weight.shape])
    return time.perf_counter() - start


def paths(qtype: str = "q4_0") -> tuple[str, ...]:
    """The products measured: each activation dtype's, and int16's on the tile unit where there is one, or on
    interleaved Q4_0 where its kernel is built and the engine lays Q4_0 out so (engine/worker/kernel_layouts.py)."""
    if tile_unit_takes("q4_0"):
        return ("float32", "int8", "int16", "int16 AMX")
    laid_out_here = qtype in LAYOUTS and rows8_kernel_built()
    return ("float32", "int8", "int16", *((INTERLEAVED,) if laid_out_here else ()))


def gb_per_second(weights: list[QuantizedWeight], tokens: int) -> list[float]:
    """Weight bytes per second over all layers for each of paths(), interleaved medians."""
    x = {k: torch.randn(tokens, k) for k in {w.shape[1] for w in weights}}
    measured = paths(weights[0].qtype)
    variants = {path: laid_out(weights, path) for path in measured}
    times: dict[str, list[float]] = {path: [] for path in measured}
    for dtype in times:
        pass_seconds(variants[dtype], x, dtype)  # warm-up
    for _ in range(SAMPLES):
        for dtype, elapsed in times.items():
            elapsed.append(pass_seconds(variants[dtype], x, dtype))
    nbytes = sum(w.nbytes for w in weights)
    return [nbytes / statistics.median(times[path]) / 1e9 for path in measured]


def copy_gb_per_second() -> float:
    """Bytes read per second by a large torch copy (median of a few)."""
    source = torch.ones(COPY_BYTES, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(SAMPLES):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return COPY_BYTES / statistics.median(times) / 1e9


def cached_ns_per_block(qtype: str, tokens: int, rounds: int = 7, calls: int = 50) -> list[float]:
    """One thread's CPU nanoseconds per 32 weights and token for each of paths(), the weight in cache (--cached)."""
    weight = quantize(torch.randn(ROWS_CACHED, 2048, generator=torch.Generator().manual_seed(0)) * 0.02, qtype)
    x, out = torch.randn(tokens, 2048), torch.empty(tokens, ROWS_CACHED)
    best = dict.fromkeys(paths(qtype), float("inf"))
    variants = {path: laid_out([weight], path)[0] for path in best}
    for _ in range(rounds):
        for dtype in best:
            kernel = kernel_of(dtype)
            kernel(x, variants[dtype], None, out)
            start = time.thread_time()
            for _ in range(calls):
                kernel(x, variants[dtype], None, out)
            best[dtype] = min(best[dtype], (time.thread_time() - start) / calls)
    blocks = ROWS_CACHED * 2048 / 32 * tokens
    return [best[dtype] / blocks * 1e9 for dtype in best]


def extra_path() -> str | None:
    """The product measured beside the three dtypes' where there is one (a column of its own): "int16 AMX" or
    "int16 r8"; formats it does not take show "-" there."""
    measured = paths("q4_0")
    return measured[3] if len(measured) > 3 else None


def print_cached(formats: list[str], token_counts: list[int]) -> None:
    torch.set_num_threads(1)
    extra = extra_path()
    print(
        "| format | tokens | float32 ns | int8 ns | int16 ns | int16 / float32 time |"
        + (f" {extra} ns |" if extra else "")
    )
    print("|---|---:|---:|---:|---:|---:|" + ("---:|" if extra else ""))
    for qtype in formats:
        for tokens in token_counts:
            float_ns, int8_ns, int16_ns, *extra_ns = cached_ns_per_block(qtype, tokens)
            cells = "".join(f" {ns:.2f} |" for ns in extra_ns) or (" - |" if extra else "")
            print(f"| {qtype.upper()} | {tokens} | {float_ns:.2f} | {int8_ns:.2f} | {int16_ns:.2f} | "
                  f"{int16_ns / float_ns:.2f} |" + cells)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cached", action="store_true", help="one thread's CPU time, the weight in cache")
    args = parser.parse_args()
    if int8_linear_kernel() is None:
        raise SystemExit("the native kernels could not be built (no C compiler?)")
    if args.cached:
        path = native_function("int8_kernel_path", [])
        print(f"{cpu_model()}; int8 kernels: {KERNEL_PATHS[path()] if path else '?'}; one thread, CPU time")
        started = datetime.datetime.now(datetime.timezone.utc)
        print(f"{started:%Y-%m-%d %H:%M} UTC; 1-minute load average {os.getloadavg()[0]:.2f}\n")
        print_cached(args.formats.split(","), [int(t) for t in args.tokens.split(",")])
        return
    torch.set_num_threads(args.threads)
    path = native_function("int8_kernel_path", [])
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()[0]
    copy_before = copy_gb_per_second()
    rows = []
    for qtype in args.formats.split(","):
        weights = layers_of(qtype)
        for tokens in map(int, args.tokens.split(",")):
            rows.append((qtype, tokens, *gb_per_second(weights, tokens)))
        del weights
    copy_after = copy_gb_per_second()
    print(f"{cpu_model()}, {os.cpu_count()} cores, {args.threads} threads; torch {torch.__version__}")
    print(f"int8 kernels: {KERNEL_PATHS[path()] if path else '?'}")
    print(
        f"{started:%Y-%m-%d %H:%M} UTC; 1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print(f"copy bandwidth: {copy_before:.1f} GB/s read (before), {copy_after:.1f} (after)\n")
    extra = extra_path()
    print(
        "| format | tokens | float32 GB/s | int8 GB/s | int16 GB/s | int8 / float32 | int16 / float32 | int16 / copy |"
        + (f" {extra} GB/s | {extra} / int16 | {extra} / copy |" if extra else "")
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if extra else ""))
    copy = max(copy_before, copy_after)
    for qtype, tokens, float_gbs, int8_gbs, int16_gbs, *extra_gbs in rows:
        cells = "".join(f" {gbs:.1f} | {gbs / int16_gbs:.2f} | {gbs / copy:.0%} |" for gbs in extra_gbs)
        print(
            f"| {qtype.upper()} | {tokens} | {float_gbs:.1f} | {int8_gbs:.1f} | {int16_gbs:.1f} | "
            f"{int8_gbs / float_gbs:.2f} | {int16_gbs / float_gbs:.2f} | {int16_gbs / copy:.0%} |"
            + (cells or (" - | - | - |" if extra else ""))
        )
    allow_tile_unit(True)


if __name__ == "__main__":
    main()
