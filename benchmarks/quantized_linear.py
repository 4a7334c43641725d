"""Linear layers on GGUF-quantized weights (kernels/quantized.py) against the float32 path the engine runs today.

SmolLM2-135M's projections, each timed with the Q4_1 and Q8_0 kernels and with the two float32 paths: the
skinny-matrix kernel (kernels/cpu_linear.py: what the CPU backend runs for decode batches) and torch's matmul.
The four calls are interleaved (A B C D A B C D ...) so that a shared machine's slow moments hit all of them,
and each path cycles through enough copies of its weight (COPY_BYTES) that every call reads it from memory,
as in a decode step, not from the last-level cache. Medians of SAMPLES calls per path; a ratio above 1 means the
quantized kernel is faster.

Then one decode step of one sequence (T = 1): every projection of the 30 layers as the engine lays them out
(fused q/k/v and gate/up), Q4_1, and the LM head in Q8_0 (as in SmolLM2's GGUF), against the same in float32,
with the bytes of weights each reads.

Last, why the kernels take every token count: against kernels/quantized.py's torch path (dequantized tiles of
256 rows into torch's float32 matmul) at 16-2048 tokens, a decode batch to a prefill step, on the two shapes of
SmolLM2's MLP.

    python -m benchmarks.quantized_linear
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# The engine's setting (engine/openmp_policy.py), before torch loads: torch's OpenMP workers sleep once an op
# ends. Left spinning, they take the cores from the kernels' own pool between calls, and the tiled path,
# which alternates the two pools, runs ten times slower or worse.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from pagedserve.kernels.cpu_linear import skinny_linear_kernel
from pagedserve.kernels.quantized import (
    QuantizedWeight,
    quantize,
    quantized_linear,
    quantized_linear_kernel,
    tiled_linear,
)

# (name, out, in): the projections as SmolLM2's GGUF stores them.
PROJECTIONS = (
    ("q_proj, o_proj", 576, 576),
    ("k_proj, v_proj", 192, 576),
    ("gate_proj, up_proj", 1536, 576),
    ("down_proj", 576, 1536),
    ("lm_head", 49152, 576),
)
# One layer as the engine lays it out (engine/worker/models/llama.py): q/k/v and gate/up fused.
LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LM_HEAD = (49152, 576)
NUM_LAYERS = 30
TOKENS = (1, 4, 8, 16, 32)
SAMPLES = 100
STEP_SAMPLES = 15
CROSSOVER_SHAPES = ((1536, 576), (576, 1536))
CROSSOVER_TOKENS = (16, 32, 64, 128, 512, 2048)
COPY_BYTES = 96 << 20  # 3x this machine's 32 MiB L3: each path's copies of a weight stream from memory
Call = Callable[[int], object]  # runs one product on copy i of its weights


@dataclass(frozen=True)
class Row:
    name: str
    shape: tuple[int, int]
    tokens: int
    q4_1_us: float
    q8_0_us: float
    kernel_us: float
    torch_us: float


def copies(tensor: torch.Tensor, nbytes: int) -> list[torch.Tensor]:
    """Enough clones of `tensor` (each in memory of its own) to cycle through COPY_BYTES."""
    return [tensor.clone() for _ in range(max(1, math.ceil(COPY_BYTES / nbytes)))]


def quantized_copies(weight: QuantizedWeight) -> list[QuantizedWeight]:
    return [QuantizedWeight(weight.qtype, blocks, weight.shape) for blocks in copies(weight.blocks, weight.nbytes)]


def interleaved_medians_us(calls: Sequence[Call], samples: int) -> list[float]:
    """Median microseconds of each call, run in turn (A B C A B C ...) on successive copies, after a warm-up."""
    for call in calls:
        call(0)
    times: list[list[float]] = [[] for _ in calls]
    for i in range(samples):
        for call, elapsed in zip(calls, times):
            start = time.perf_counter()
            call(i)
            elapsed.append(time.perf_counter() - start)
    return [1e6 * statistics.median(elapsed) for elapsed in times]


def projection_rows(name: str, out_features: int, in_features: int) -> list[Row]:
    """The four paths on one projection shape, at each token count."""
    kernel = skinny_linear_kernel()
    assert kernel is not None
    dense = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.05
    floats = copies(dense, dense.numel() * 4)
    q4_1, q8_0 = quantized_copies(quantize(dense, "q4_1")), quantized_copies(quantize(dense, "q8_0"))
    rows = []
    for tokens in TOKENS:
        x = torch.randn(in_features, tokens).t()  # feature-major, as the CPU backend passes a decode batch
        calls: list[Call] = [
            lambda i, x=x: quantized_linear(x, q4_1[i % len(q4_1)]),
            lambda i, x=x: quantized_linear(x, q8_0[i % len(q8_0)]),
            lambda i, x=x: kernel(x, floats[i % len(floats)], None),
            lambda i, x=x: torch.mm(floats[i % len(floats)], x.t()),  # the orientation CpuBackend.linear uses
        ]
        rows.append(Row(name, (out_features, in_features), tokens, *interleaved_medians_us(calls, SAMPLES)))
    return rows


def step_ms() -> tuple[float, float, int, int]:
    """Median milliseconds of one decode step's projections at T = 1, quantized and float32 (skinny kernel),
    interleaved, and the bytes of weights each reads."""
    kernel = skinny_linear_kernel()
    assert kernel is not None
    generator = torch.Generator().manual_seed(1)
    layer = [torch.randn(shape, generator=generator) * 0.05 for shape in LAYER]
    layer_q = [quantize(w, "q4_1") for w in layer]
    head = torch.randn(LM_HEAD, generator=generator) * 0.05
    # every layer's weights in memory of their own, as in the model
    floats = [w.clone() for _ in range(NUM_LAYERS) for w in layer] + [head]
    quantized = [QuantizedWeight(q.qtype, q.blocks.clone(), q.shape) for _ in range(NUM_LAYERS) for q in layer_q]
    quantized.append(quantize(head, "q8_0"))
    x = {width: torch.randn(1, width) for width in {576, 1536}}
    quantized_ms, float_ms = interleaved_medians_us(
        [
            lambda _: [quantized_linear(x[w.shape[1]], w) for w in quantized],
            lambda _: [kernel(x[w.shape[1]], w, None) for w in floats],
        ],
        STEP_SAMPLES,
    )
    return quantized_ms / 1000, float_ms / 1000, sum(w.nbytes for w in quantized), sum(4 * w.numel() for w in floats)


def crossover_us(out_features: int, in_features: int) -> list[tuple[int, float, float]]:
    """(tokens, kernel µs, tiled µs) of a Q4_1 weight at each of CROSSOVER_TOKENS."""
    kernel = quantized_linear_kernel()
    assert kernel is not None
    dense = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(2)) * 0.05
    weights = quantized_copies(quantize(dense, "q4_1"))
    results = []
    for tokens in CROSSOVER_TOKENS:
        x, out = torch.randn(tokens, in_features), torch.empty(tokens, out_features)
        calls: list[Call] = [
            lambda i, x=x, out=out: kernel(x, weights[i % len(weights)], None, out),
            lambda i, x=x, out=out: tiled_linear(x, weights[i % len(weights)], None, out),
        ]
        results.append((tokens, *interleaved_medians_us(calls, SAMPLES // 4)))
    return results


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def print_projection_table(rows: list[Row]) -> None:
    print("| projection | out x in | tokens | Q4_1 µs | Q8_0 µs | f32 kernel µs | f32 torch µs |", end="")
    print(" f32 kernel / Q4_1 | f32 kernel / Q8_0 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r.name} | {r.shape[0]} x {r.shape[1]} | {r.tokens} | {r.q4_1_us:.0f} | {r.q8_0_us:.0f} | "
            f"{r.kernel_us:.0f} | {r.torch_us:.0f} | {r.kernel_us / r.q4_1_us:.2f} | {r.kernel_us / r.q8_0_us:.2f} |"
        )


def print_step_table(quantized_ms: float, float_ms: float, quantized_bytes: int, float_bytes: int) -> None:
    print("| one decode step, T = 1 | ms | weights read | GB/s |")
    print("|---|---:|---:|---:|")
    for label, ms, nbytes in (
        ("Q4_1 layers + Q8_0 LM head", quantized_ms, quantized_bytes),
        ("float32 (skinny kernel)", float_ms, float_bytes),
    ):
        print(f"| {label} | {ms:.2f} | {nbytes / 2**20:.0f} MiB | {nbytes / ms / 1e6:.1f} |")
    time_ratio, byte_ratio = float_ms / quantized_ms, float_bytes / quantized_bytes
    print(f"\nfloat32 / quantized: {time_ratio:.2f}x the time, {byte_ratio:.2f}x the bytes")


def print_crossover_table(shapes: dict[tuple[int, int], list[tuple[int, float, float]]]) -> None:
    print("| Q4_1 out x in | tokens | kernel µs | tiles + matmul µs | tiled / kernel |")
    print("|---|---:|---:|---:|---:|")
    for (out_features, in_features), results in shapes.items():
        for tokens, kernel_us, tiled_us in results:
            ratio = tiled_us / kernel_us
            print(f"| {out_features} x {in_features} | {tokens} | {kernel_us:.0f} | {tiled_us:.0f} | {ratio:.2f} |")


def main() -> None:
    if skinny_linear_kernel() is None:
        raise SystemExit("the native kernels could not be built (no C compiler?)")
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()[0]
    rows = [
        row
        for name, out_features, in_features in PROJECTIONS
        for row in projection_rows(name, out_features, in_features)
    ]
    step = step_ms()
    crossover = {shape: crossover_us(*shape) for shape in CROSSOVER_SHAPES}
    print(f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads; torch {torch.__version__}")
    print(
        f"{started:%Y-%m-%d %H:%M} UTC; 1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print(
        f"medians of {SAMPLES} interleaved calls per path (the step: {STEP_SAMPLES}); weights from memory, not cache\n"
    )
    print_projection_table(rows)
    print()
    print_step_table(*step)
    print()
    print_crossover_table(crossover)


if __name__ == "__main__":
    main()
