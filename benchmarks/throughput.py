"""Offline throughput: pagedserve against three ways of running transformers, one workload, one run.

    python -m benchmarks.throughput            # the full comparison (about 10 minutes on 2 CPU cores)
    python -m benchmarks.throughput --quick    # fewer requests, for a smoke run

(a) transformers `generate`, one request at a time (measured on a few requests: its rate does not depend on
    how many there are); (b) `generate` on left-padded static batches of 32; (c) transformers' continuous
    batching (`generate_batch`); (d) pagedserve `LLM.generate`. All greedy, float32, fixed output length.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as engine/__init__.py does, but torch loads first here

import torch
import transformers

from benchmarks.workloads import chat_prompts
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path, iter_safetensors
from pagedserve.engine.worker.weights.gguf_files import dequantized_model_dir


@dataclass
class Result:
    name: str
    requests: int
    output_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def measure_matmul_gflops(size: int = 1024, repeats: int = 20) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def hf_one_at_a_time(model, prompts: list[list[int]], output_len: int) -> Result:
    start = time.perf_counter()
    for ids in prompts:
        model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
        )
    return Result(
        "(a) transformers generate, 1 at a time", len(prompts), len(prompts) * output_len, time.perf_counter() - start
    )


def hf_static_batches(model, tokenizer, prompts: list[list[int]], output_len: int, batch: int) -> Result:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        group = prompts[first : first + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    name = f"(b) transformers generate, static batches of {batch}"
    return Result(name, len(prompts), len(prompts) * output_len, time.perf_counter() - start)


def hf_continuous_batching(model, prompts: list[list[int]], output_len: int) -> Result:
    config = transformers.GenerationConfig(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, eos_token_id=None
    )
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=config, progress_bar=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return Result("(c) transformers generate_batch (continuous)", len(prompts), tokens, seconds)


def pagedserve_run(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[Result, dict[str, float]]:
    llm.stats(reset=True)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.stats()
    extra = {
        "outside_forward": 1 - stats.forward_seconds / stats.step_seconds,
        "kv_use": stats.peak_kv_tokens / max(1, stats.peak_kv_slots),
        "peak_running": stats.peak_running,
    }
    return Result("(d) pagedserve LLM.generate", len(prompts), tokens, seconds), extra


def report(result: Result) -> Result:
    """Prints a result as soon as it exists, so a long run shows its progress."""
    print(
        f"| {result.name} | {result.requests} | {result.output_tokens} | {result.seconds:.1f} | "
        f"{result.tokens_per_second:.1f} |",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=20)
    parser.add_argument("--max-prompt", type=int, default=400)
    parser.add_argument("--one-at-a-time-requests", type=int, default=4)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--skip-continuous", action="store_true", help="skip transformers' generate_batch (slow on CPU)"
    )
    parser.add_argument("--quick", action="store_true", help="16 requests of 32 tokens")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.output_len, args.one_at_a_time_requests = 16, 32, 2

    model_dir = dequantized_model_dir(embedded_gguf_path())
    llm = LLM(model=str(model_dir), max_num_seqs=max(64, args.num_requests), max_num_batched_tokens=2048)
    prompts = chat_prompts(llm.tokenizer, args.num_requests, args.min_prompt, args.max_prompt)
    print(
        f"workload: {len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
        f"(mean {sum(map(len, prompts)) / len(prompts):.0f}), {args.output_len} output tokens each, greedy, float32"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    pagedserve_run(llm, prompts[:4], 4)  # warm-up
    print("| system | requests | output tokens | seconds | output tok/s |")
    print("|---|---:|---:|---:|---:|")
    ours, extra = pagedserve_run(llm, prompts, args.output_len)
    results = [report(ours)]
    if not args.skip_transformers:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        with torch.inference_mode():
            results.append(report(hf_one_at_a_time(hf, prompts[: args.one_at_a_time_requests], args.output_len)))
            results.append(report(hf_static_batches(hf, tokenizer, prompts, args.output_len, batch=32)))
            if not args.skip_continuous:
                results.append(report(hf_continuous_batching(hf, prompts, args.output_len)))
    _, extra32 = pagedserve_run(llm, prompts[:32], args.output_len)

    gflops = measure_matmul_gflops()
    params = sum(t.numel() for _, t in iter_safetensors(model_dir))
    ceiling = gflops * 1e9 / (2 * params)
    print()
    for r in results[1:]:
        print(f"pagedserve vs {r.name}: {ours.tokens_per_second / r.tokens_per_second:.2f}x")
    print(
        f"fp32 matmul here: {gflops:.0f} GFLOP/s -> compute ceiling {ceiling:.0f} tok/s "
        f"for {params / 1e6:.0f}M params; "
        f"pagedserve reaches {ours.tokens_per_second / ceiling:.0%} of it"
    )
    print(
        f"share of engine step time outside the model forward: {extra['outside_forward']:.1%} "
        f"({ours.requests} requests), {extra32['outside_forward']:.1%} at 32 running requests"
    )
    print(f"KV slots holding tokens at the peak: {extra['kv_use']:.1%} (peak running {extra['peak_running']})")


if __name__ == "__main__":
    main()
