"""Decode paged attention on one GPU, Llama-3-8B layer shape: 32 query heads, 8 KV heads, head_dim 128,
block size 16, bfloat16.

For each batch size and context length it reports the Triton kernel's time, the bytes of K/V one call
reads, the bandwidth that implies and its share of the device's measured copy bandwidth, and the time of
torch's scaled_dot_product_attention over the same keys/values stored contiguously ("sdpa/triton" above 1
means the paged kernel is faster).

    python -m benchmarks.kernels [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.kernels.metadata import AttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
SCALE = HEAD_DIM**-0.5
BATCH_SIZES = (1, 8, 64, 256)
CONTEXT_LENS = (512, 2048, 8192)
COPY_BYTES = 2 << 30


@dataclass
class DecodeResult:
    batch: int
    context: int
    num_splits: int
    triton_us: float
    kv_bytes: int
    triton_gbps: float
    copy_share: float  # triton_gbps / measured copy bandwidth
    sdpa_us: float | None  # None where SDPA could not run (memory, unsupported backend)
    sdpa_over_triton: float | None


def time_ms(fn: Callable[[], object]) -> float:
    """Median GPU time of one call, replayed in a CUDA graph so host launch overhead does not hide it."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=100, return_mode="median")


def cpu_median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of one call on the CPU, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of a large buffer: bytes read plus bytes written per second."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / time_ms(lambda: dst.copy_(src)) / 1e6


@dataclass(frozen=True)
class DecodeShape:
    """One attention layer's shape and where its cache lives."""

    num_heads: int = NUM_HEADS
    num_kv_heads: int = NUM_KV_HEADS
    head_dim: int = HEAD_DIM
    block_size: int = BLOCK_SIZE
    dtype: torch.dtype = DTYPE
    device: str = "cuda"


def paged_decode_inputs(batch: int, context: int, shape: DecodeShape = DecodeShape()) -> tuple[torch.Tensor, ...]:
    """query [B, H, D], caches, and block tables that scatter each sequence over random blocks."""
    blocks_per_seq = context // shape.block_size
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=shape.dtype, device=shape.device)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=shape.device).int().view(batch, blocks_per_seq)
    query = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=shape.dtype, device=shape.device)
    return query, k_cache, v_cache, block_tables


def decode_metadata(
    batch: int, context: int, block_tables: torch.Tensor, block_size: int = BLOCK_SIZE
) -> AttentionMetadata:
    device = block_tables.device
    return AttentionMetadata(
        block_tables=block_tables,
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        slot_mapping=torch.full((batch,), -1, dtype=torch.long, device=device),
        block_size=block_size,
        query_lens_host=[1] * batch,
        seq_lens_host=[context] * batch,
    )


def sdpa_ms(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> float | None:
    """SDPA over the same keys/values gathered into contiguous [B, KVH, L, D] tensors."""
    batch = query.shape[0]
    try:
        key, value = (
            cache[block_tables.long()].view(batch, -1, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
            for cache in (k_cache, v_cache)
        )
        q = query.unsqueeze(2)
        return time_ms(lambda: F.scaled_dot_product_attention(q, key, value, scale=SCALE, enable_gqa=True))
    except RuntimeError as error:  # out of memory, or no SDPA backend for this shape
        print(f"  sdpa skipped at batch {batch}: {str(error).splitlines()[0]}", file=sys.stderr)
        return None


def bench_decode(batch: int, context: int, copy_gbps: float) -> DecodeResult:
    from pagedserve.kernels.triton_backend import TritonBackend

    query, k_cache, v_cache, block_tables = paged_decode_inputs(batch, context)
    backend = TritonBackend()
    metadata = backend.prepare(decode_metadata(batch, context, block_tables))
    num_splits = backend.launch_for(metadata, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM).num_splits
    triton_time = time_ms(lambda: backend.paged_attention(query, k_cache, v_cache, metadata, SCALE))
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    triton_gbps = kv_bytes / triton_time / 1e6
    sdpa_time = sdpa_ms(query, k_cache, v_cache, block_tables)
    return DecodeResult(
        batch=batch,
        context=context,
        num_splits=num_splits,
        triton_us=triton_time * 1e3,
        kv_bytes=kv_bytes,
        triton_gbps=triton_gbps,
        copy_share=triton_gbps / copy_gbps,
        sdpa_us=None if sdpa_time is None else sdpa_time * 1e3,
        sdpa_over_triton=None if sdpa_time is None else sdpa_time / triton_time,
    )


def print_table(results: list[DecodeResult]) -> None:
    header = f"{'batch':>6} {'context':>8} {'splits':>6} {'triton_us':>10} {'kv_MB':>9} {'GB/s':>8} "
    print(header + f"{'%copy':>6} {'sdpa_us':>9} {'sdpa/triton':>11}")
    for r in results:
        sdpa = "n/a" if r.sdpa_us is None else f"{r.sdpa_us:.1f}"
        ratio = "n/a" if r.sdpa_over_triton is None else f"{r.sdpa_over_triton:.2f}"
        print(
            f"{r.batch:>6} {r.context:>8} {r.num_splits:>6} {r.triton_us:>10.1f} {r.kv_bytes / 1e6:>9.1f} "
            f"{r.triton_gbps:>8.0f} {r.copy_share:>6.0%} {sdpa:>9} {ratio:>11}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py times CUDA kernels and found no CUDA device: nothing measured.")
        return 0
    device = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth_gbps()
    print(f"{device}: device copy bandwidth {copy_gbps:.0f} GB/s (read + write of {COPY_BYTES >> 30} GiB)")
    print(f"decode, {NUM_HEADS} heads / {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, block {BLOCK_SIZE}, bf16")
    results = []
    for batch in BATCH_SIZES:
        for context in CONTEXT_LENS:
            results.append(bench_decode(batch, context, copy_gbps))
            torch.cuda.empty_cache()
    print_table(results)
    if args.json:
        report = {"device": device, "copy_gbps": copy_gbps, "results": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
