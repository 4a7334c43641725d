"""Linear layers on K-quant weights (Q4_K, Q6_K: csrc/kquant_linear.c) against Q4_1 and float32.

For each projection shape and token count: microseconds of quantized_linear with Q4_K, Q6_K and Q4_1 weights and
of torch's float32 linear, interleaved (A B C D A B C D ...) so that a shared machine's slow moments hit all of
them, each cycling through enough copies of its weight that every call reads it from memory, as in a decode
step (helpers from benchmarks/quantized_linear.py). Medians of SAMPLES calls per path.

SmolLM2-135M's projections (as the engine fuses them) come first. Their 576-wide inputs are not whole 256-weight
super-blocks, so K-quants cannot store them (llama.cpp's Q4_K_M files fall back to other types for such
tensors): those rows have Q4_1 and float32 only. TinyLlama-1.1B's projections (2048 and 5632 wide) follow, for a
comparison on every path.

    python -m benchmarks.kquant_linear
"""

from __future__ import annotations

import datetime
import os
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


def main() -> None:
    if quantized_linear_kernel() is None:
        raise SystemExit("the native kernels could not be built (no C compiler?)")
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()[0]
    results = {(model, name, o, i): projection_rows(o, i) for model, name, o, i in PROJECTIONS}
    print(f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads; torch {torch.__version__}")
    print(
        f"{started:%Y-%m-%d %H:%M} UTC; 1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print(f"medians of {SAMPLES} interleaved calls per path; weights from memory, not cache\n")
    print_table(results)


if __name__ == "__main__":
    main()
