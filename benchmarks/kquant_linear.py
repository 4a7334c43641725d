"""Linear layers on K-quant weights (Q4_K, Q6_K: csrc/kquant_linear.c) against Q4_1 and float32.

For each projection shape and token count: microseconds of quantized_linear with Q4_K, Q6_K and Q4_1 weights and
of torch's float32 linear, interleaved (A B C D A B C D ...) so that a shared machine's slow moments hit all of
them, each cycling through enough copies of its weight that every call reads it from memory, as in a decode
step (helpers from benchmarks/quantized_linear.py). Medians of SAMPLES calls per path.

With --bandwidth, instead: one token on every block format, interleaved, on TinyLlama's gate_up and down
projections, as GB/s of weights read (the bytes of the blocks over the median time): how close each format's
single-token kernel comes to the machine's memory bandwidth. Then each format's arithmetic alone: one thread
on a weight that stays in cache, as the CPU time of the calling thread per 32 weights, which other processes
on a shared machine barely move.

SmolLM2-135M's projections (as the engine fuses them) come first. Their 576-wide inputs are not whole 256-weight
super-blocks, so K-quants cannot store them (llama.cpp's Q4_K_M files fall back to other types for such
tensors): those rows have Q4_1 and float32 only. TinyLlama-1.1B's projections (2048 and 5632 wide) follow, for a
comparison on every path.

    python -m benchmarks.kquant_linear [--bandwidth]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as benchmarks/quantized_linear.py: before torch loads

import torch

from benchmarks.quantized_linear import copies, cpu_model, interleaved_medians_us, quantized_copies
from pagedserve.kernels.quantized import FORMATS, quantize, quantized_linear, quantized_linear_kernel

# (model, projection, out, in)
PROJECTIONS = (
    ("SmolLM2-135M", "qkv_proj", 960, 576),
    ("SmolLM2-135M", "o_proj", 576, 576),
    ("SmolLM2-135M", "gate_up_proj", 3072, 576),
    ("SmolLM2-135M", "down_proj", 576, 1536),
    ("TinyLlama-1.1B", "qkv_proj", 2560, 2048),
    ("TinyLlama-1.1B", "o_proj", 2048, 2048),
    ("TinyLlama-1.1B", "gate_up_proj", 11264, 2048),
    ("TinyLlama-1.1B", "down_proj", 2048, 5632),
)
QTYPES = ("q4_k", "q6_k", "q4_1")
TOKENS = (1, 4, 16)
SAMPLES = 60
Call = Callable[[int], object]


def quantized_calls(dense: torch.Tensor, x: torch.Tensor) -> dict[str, Call]:
    """A call per format that can store `dense`."""
    calls: dict[str, Call] = {}
    for qtype in QTYPES:
        if dense.shape[1] % FORMATS[qtype].block_weights == 0:
            weights = quantized_copies(quantize(dense, qtype))
            calls[qtype] = lambda i, weights=weights: quantized_linear(x, weights[i % len(weights)])
    return calls


def projection_rows(out_features: int, in_features: int) -> list[tuple[int, dict[str, float]]]:
    """(tokens, microseconds by path) at each token count."""
    dense = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.05
    floats = copies(dense, dense.numel() * 4)
    rows = []
    for tokens in TOKENS:
        x = torch.randn(tokens, in_features)
        calls = quantized_calls(dense, x)
        calls["f32"] = lambda i, x=x: torch.nn.functional.linear(x, floats[i % len(floats)])
        rows.append((tokens, dict(zip(calls, interleaved_medians_us(list(calls.values()), SAMPLES)))))
    return rows


def print_table(results: dict[tuple[str, str, int, int], list[tuple[int, dict[str, float]]]]) -> None:
    paths = (*QTYPES, "f32")
    print("| model | projection | out x in | tokens | " + " | ".join(f"{p.upper()} µs" for p in paths) + " |")
    print("|---|---|---|---:|" + "---:|" * len(paths))
    for (model, name, out_features, in_features), rows in results.items():
        for tokens, us in rows:
            cells = " | ".join(f"{us[p]:.0f}" if p in us else "n/a" for p in paths)
            print(f"| {model} | {name} | {out_features} x {in_features} | {tokens} | {cells} |")


# --bandwidth: every format, fewest bits last; TinyLlama's widest projections.
BANDWIDTH_QTYPES = ("q8_0", "q6_k", "q5_1", "q5_0", "q5_k", "q4_1", "q4_0", "q4_k", "q3_k", "q2_k")
BANDWIDTH_SHAPES = ((11264, 2048), (2048, 5632))


def one_token_bandwidth(out_features: int, in_features: int) -> dict[str, tuple[float, float]]:
    """(microseconds, GB/s of blocks read) of one token by each of BANDWIDTH_QTYPES, interleaved."""
    dense = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.05
    x = torch.randn(1, in_features)
    weights = {qtype: quantized_copies(quantize(dense, qtype)) for qtype in BANDWIDTH_QTYPES}
    calls: list[Call] = [lambda i, w=w: quantized_linear(x, w[i % len(w)]) for w in weights.values()]
    medians = interleaved_medians_us(calls, SAMPLES)
    return {q: (us, w[0].nbytes / us / 1e3) for (q, w), us in zip(weights.items(), medians)}


def compute_ns_per_32_weights(out_features: int = 512, in_features: int = 2048, calls: int = 100) -> dict[str, float]:
    """Median over 7 rounds of each format's thread CPU time per 32 weights, one token, one thread, the weight
    (under 1.1 MB in every format) in cache."""
    dense = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(1)) * 0.05
    x, out = torch.randn(1, in_features), torch.empty(1, out_features)
    weights = {qtype: quantize(dense, qtype) for qtype in BANDWIDTH_QTYPES}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rounds: dict[str, list[float]] = {qtype: [] for qtype in weights}
    try:
        for _ in range(7):
            for qtype, weight in weights.items():
                quantized_linear(x, weight, out=out)
                start = time.thread_time()
                for _ in range(calls):
                    quantized_linear(x, weight, out=out)
                rounds[qtype].append((time.thread_time() - start) / calls)
    finally:
        torch.set_num_threads(threads)
    groups = out_features * in_features / 32
    return {qtype: 1e9 * statistics.median(seconds) / groups for qtype, seconds in rounds.items()}


def print_bandwidth_table(
    results: dict[tuple[int, int], dict[str, tuple[float, float]]], compute_ns: dict[str, float]
) -> None:
    shapes = list(results)
    header = " | ".join(f"{o} x {i}: µs, GB/s" for o, i in shapes)
    print(f"| format | bits a weight | {header} | 1 thread, cached: ns / 32 weights |")
    print("|---|---:|" + "---:|" * (len(shapes) + 1))
    for qtype in BANDWIDTH_QTYPES:
        fmt = FORMATS[qtype]
        cells = " | ".join(f"{results[s][qtype][0]:,.0f}, {results[s][qtype][1]:.1f}" for s in shapes)
        bits = 8 * fmt.block_bytes / fmt.block_weights
        print(f"| {qtype.upper()} | {bits:.2f} | {cells} | {compute_ns[qtype]:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bandwidth", action="store_true", help="one token on every format, as GB/s")
    bandwidth = parser.parse_args().bandwidth
    if quantized_linear_kernel() is None:
        raise SystemExit("the native kernels could not be built (no C compiler?)")
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()[0]
    if bandwidth:
        results = {shape: one_token_bandwidth(*shape) for shape in BANDWIDTH_SHAPES}
        compute_ns = compute_ns_per_32_weights()
    else:
        table = {(model, name, o, i): projection_rows(o, i) for model, name, o, i in PROJECTIONS}
    print(f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads; torch {torch.__version__}")
    print(
        f"{started:%Y-%m-%d %H:%M} UTC; 1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print(f"medians of {SAMPLES} interleaved calls per path; weights from memory, not cache\n")
    if bandwidth:
        print_bandwidth_table(results, compute_ns)
    else:
        print_table(table)


if __name__ == "__main__":
    main()
