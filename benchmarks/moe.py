"""Mixture of experts: a random Qwen3-MoE served end to end, and the expert layer alone.

    python -m benchmarks.moe            # both parts (a few minutes on 2 CPU cores)
    python -m benchmarks.moe --quick    # smaller, for a smoke run
    python -m benchmarks.moe --device cuda

(1) Output tokens/s of `LLM.generate` on a random Qwen3-MoE (float32 on the CPU, bfloat16 on CUDA) at 1 stream
    (one request at a time) and 8 streams (8 requests at once), greedy, fixed output length.
(2) One expert layer's time (router excluded, fastest of interleaved calls) on the backend the engine picks for
    the device: the engine's expert product (kernels/moe.py: tokens grouped by expert with one argsort, one
    product per expert over its rows; on CUDA the fused Triton kernels) against transformers' loop (a boolean
    mask over the batch per expert, the same per-expert products), at several token counts.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as engine/__init__.py does, but torch loads first here

import torch
import transformers

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path
from pagedserve.engine.worker.weights.gguf_files import gguf_model_dir
from pagedserve.kernels import get_backend
from pagedserve.kernels.moe import ExpertWeights, expert_product, masked_expert_product

MODEL = dict(  # ~0.2 B parameters, 8 of 32 experts active: about a quarter of the expert weights read per token
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_experts=32,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
    vocab_size=49152,
)


def save_model(folder: Path, layers: int) -> None:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**{**MODEL, "num_hidden_layers": layers})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(gguf_model_dir(embedded_gguf_path())).save_pretrained(folder)


def tokens_per_second(
    folder: Path, streams: int, requests: int, output_len: int, device: str, quantization: str
) -> float:
    prompts = [list(range(1000 + 97 * i, 1100 + 97 * i)) for i in range(requests)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    with LLM(model=str(folder), max_num_seqs=streams, device=device, quantization=quantization) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    return sum(len(out.outputs[0].token_ids) for out in outputs) / seconds


def fastest_ms(products: list[Callable[..., torch.Tensor]], arguments: tuple, device: str, repeats: int) -> list[float]:
    """Each product's fastest call of `repeats`, in milliseconds: calls interleaved, so a busy neighbour on a
    shared machine slows both alike, and the minimum is what the code costs when it gets the cores."""
    times: list[list[float]] = [[] for _ in products]
    for repeat in range(repeats + 1):
        for product, measured in zip(products, times, strict=True):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            product(*arguments)
            if device == "cuda":
                torch.cuda.synchronize()
            if repeat:  # the first round warms up
                measured.append(time.perf_counter() - start)
    return [min(measured) * 1e3 for measured in times]


def expert_layer_table(device: str, dtype: torch.dtype, token_counts: list[int], repeats: int) -> None:
    experts, top_k = MODEL["num_experts"], MODEL["num_experts_per_tok"]
    hidden, inter = MODEL["hidden_size"], MODEL["moe_intermediate_size"]
    backend = get_backend("auto", torch.device(device))
    gen = torch.Generator().manual_seed(0)
    weights = ExpertWeights(
        (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.05).to(device, dtype),
        (torch.randn(experts, hidden, inter, generator=gen) * 0.05).to(device, dtype),
    )
    print(f"\nexpert layer, {experts} experts, top {top_k}, hidden {hidden}, width {inter}, {dtype}, {backend.name}:")
    print("| tokens | engine (grouped) ms | per-expert mask loop ms | loop / grouped |\n|---:|---:|---:|---:|")
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
        logits = torch.randn(tokens, experts, generator=gen).to(device)
        routing, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
        routing = routing.to(dtype)
        arguments = (backend, x, ids, routing, weights)
        with torch.inference_mode():
            grouped, masked = fastest_ms([expert_product, masked_expert_product], arguments, device, repeats)
        print(f"| {tokens} | {grouped:.3f} | {masked:.3f} | {masked / grouped:.2f}x |")


def serving_table(layers: int, requests: int, output_len: int, device: str, quantization: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_model(folder, layers)
        shape = f"{layers} layers, {requests} requests of 100 + {output_len} tokens"
        print(f"random Qwen3-MoE, {shape}, {device}, quantization {quantization}:")
        print("| streams | output tok/s |\n|---:|---:|")
        for streams in (1, 8):
            rate = tokens_per_second(folder, streams, requests, output_len, device, quantization)
            print(f"| {streams} | {rate:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--layer-only", action="store_true", help="only (2), the expert layer")
    parser.add_argument("--quantization", default="none", help="(1)'s weights: none, or a block format on load")
    args = parser.parse_args()
    device = args.device
    layers, requests, output_len = (2, 8, 16) if args.quick else (MODEL["num_hidden_layers"], 16, args.output_len)
    if not args.layer_only:
        serving_table(layers, requests, output_len, device, args.quantization)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    counts = [1, 8, 64] if args.quick else [1, 8, 64, 512, 2048]
    expert_layer_table(device, dtype, counts, repeats=3 if args.quick else 20)


if __name__ == "__main__":
    main()
