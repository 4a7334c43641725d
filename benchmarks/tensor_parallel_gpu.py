"""Tensor parallelism on GPUs: decode throughput at TP=2 (or other sizes) against TP=1, Llama-3-8B's shape.

    python -m benchmarks.tensor_parallel_gpu                            # TP=1 and 2, 64 and 1 streams
    python -m benchmarks.tensor_parallel_gpu --sizes 1 2 4 --layers 4   # a quick look on 4 GPUs

Random weights (load_format "dummy": timing does not depend on them), bfloat16, decode CUDA graphs on every
rank, NCCL between ranks. Each size loads one engine; per stream count it runs that many requests at once,
each `--prompt-len` random tokens then `--output-len` greedy tokens (ignore_eos): a decode-heavy load.

The table gives output tok/s, the ratio to TP=1 at the same streams, and rank 0's host time in collectives
over its step time: the engine's `tensor_parallel_communication_seconds`, as benchmarks/tensor_parallel.py
reads it. On CUDA that counter sees only the calls Python makes (eager steps: prefill); a replayed decode
graph's all-reduces pass no Python, so it is not the GPU's all-reduce time.

With fewer GPUs than the largest size (or none) it says so in one line and measures nothing; the CPU side of
tensor parallelism is benchmarks/tensor_parallel.py.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from benchmarks.gpu_throughput import LLAMA3_8B, save_placeholder_tokenizer
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams

BLOCK_SIZE = 16
WARM_UP_TOKENS = 4


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Measurement:
    size: int
    streams: int
    output_tokens_per_s: float
    collective_share: float  # rank 0's host time in collectives over its step time


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def missing_gpus_message(sizes: list[int], available: int) -> str | None:
    """Why the largest size cannot run here, or None when it can."""
    largest = max(sizes)
    if largest <= available:
        return None
    return f"TP={largest} needs {largest} GPU{'s' if largest > 1 else ''}; this machine has {available}"


def write_llama3_8b_shape(folder: Path, layers: int = 32) -> Path:
    """Llama-3-8B's config (all but the layer count) and a placeholder tokenizer: a model folder for dummy loads."""
    shape = {**LLAMA3_8B, "num_hidden_layers": layers}
    transformers.LlamaConfig(**shape, architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    save_placeholder_tokenizer(folder)
    return folder


def engine_config(model: str, size: int, max_streams: int, workload: Workload, device: str) -> EngineConfig:
    """A KV cache that holds every stream to its last token (no preemption) and nothing more, so no profiling
    pass runs and the memory a previous size left behind cannot shrink it."""
    model_len = workload.prompt_len + workload.output_len
    blocks_per_stream = -(-model_len // BLOCK_SIZE) + 1
    return EngineConfig(
        model=model,
        load_format="dummy",
        dtype="bfloat16",
        device=device,
        tensor_parallel_size=size,
        block_size=BLOCK_SIZE,
        num_kv_blocks=max_streams * blocks_per_stream,
        max_model_len=model_len,  # graphs are planned for the longest context: keep it to what runs
        max_num_seqs=max_streams,
        max_num_batched_tokens=max(2048, max_streams * workload.prompt_len),  # every prompt in one step
        enable_prefix_caching=False,  # a warm-up prompt must not spare a measured one its prefill
    )


def measure(
    engine: LLMEngine, streams: int, workload: Workload, prompts: torch.Generator, ids: itertools.count
) -> tuple[float, float]:
    """Output tok/s and collective share of `streams` requests run together to their last token."""
    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    token_ids = torch.randint(100, 30000, (streams, workload.prompt_len), generator=prompts).tolist()
    engine.collect_stats(reset=True)
    start = time.perf_counter()
    for prompt in token_ids:
        engine.add_request(str(next(ids)), prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - start
    stats = engine.collect_stats(reset=True)
    return stats.generation_tokens / seconds, stats.communication_seconds / stats.step_seconds


def run_size(model: str, size: int, streams: list[int], workload: Workload, device: str) -> list[Measurement]:
    engine = LLMEngine(engine_config(model, size, max(streams), workload, device))
    prompts, ids = torch.Generator().manual_seed(0), itertools.count()
    try:
        for count in streams:  # Triton compiles prefill kernels on first use: not in the measured runs
            measure(engine, count, Workload(workload.prompt_len, WARM_UP_TOKENS), prompts, ids)
        return [Measurement(size, count, *measure(engine, count, workload, prompts, ids)) for count in streams]
    finally:
        engine.close()


TABLE_HEADER = [
    "| TP | streams | output tok/s | vs TP=1 | collectives (host) / step |",
    "|---:|---:|---:|---:|---:|",
]


def table_row(measurement: Measurement, baseline: dict[int, float]) -> str:
    """One row; `baseline` maps streams to TP=1's tok/s (no ratio without it)."""
    base = baseline.get(measurement.streams)
    ratio = "-" if base is None else f"{measurement.output_tokens_per_s / base:.2f}x"
    rate, share = measurement.output_tokens_per_s, measurement.collective_share
    return f"| {measurement.size} | {measurement.streams} | {rate:.1f} | {ratio} | {share:.1%} |"


def run_table(model: str, sizes: list[int], streams: list[int], workload: Workload, device: str) -> None:
    """Measures each size in turn (TP=1 first, for the ratios), printing rows as they come."""
    print("\n".join(TABLE_HEADER), flush=True)
    baseline: dict[int, float] = {}
    for size in sorted(set(sizes)):
        for measurement in run_size(model, size, streams, workload, device):
            if size == 1:
                baseline[measurement.streams] = measurement.output_tokens_per_s
            print(table_row(measurement, baseline), flush=True)
        gc.collect()  # the closed engine's weights, cache and graphs, before the next size allocates its own
        if device == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 1], help="concurrent requests per run")
    parser.add_argument("--layers", type=int, default=32, help="fewer than Llama-3-8B's 32 for a quick check")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    args = parser.parse_args(argv)
    missing = missing_gpus_message(args.sizes, visible_gpus())
    if missing:
        print(f"tensor_parallel_gpu: {missing}; nothing measured")
        return
    print(f"{torch.cuda.get_device_name()} x {visible_gpus()}, Llama-3-8B shape with {args.layers} layers, bfloat16")
    with tempfile.TemporaryDirectory(prefix="llama3-8b-shape-") as folder:
        model = str(write_llama3_8b_shape(Path(folder), args.layers))
        run_table(model, args.sizes, args.streams, Workload(args.prompt_len, args.output_len), "cuda")


if __name__ == "__main__":
    main()
