"""End-to-end decode throughput on CUDA with a Llama-3-8B-shaped model and random weights.

    python -m benchmarks.gpu_throughput [--num-requests 256 --prompt-len 512 --output-len 256] [--json out.json]

Prints pagedserve's output tokens/s, the weights-plus-KV bandwidth bound of a decode step at that batch
(measured device copy bandwidth), and, unless --skip-transformers, transformers' continuous batching
(`generate_batch`) on the same random model and requests.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import transformers

from pagedserve.engine import LLM, SamplingParams

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    vocab_size=128256,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def save_placeholder_tokenizer(folder: Path) -> None:
    """A word-level tokenizer: prompts are token ids and outputs are not decoded, so any tokenizer will do."""
    from tokenizers import Tokenizer, models

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(folder)


def copy_bandwidth_gbs(num_bytes: int = 2 << 30) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * num_bytes * 10 / (time.perf_counter() - start) / 1e9  # read + write


def decode_bound_tokens_per_s(config: transformers.LlamaConfig, batch: int, mean_context: float, gbs: float) -> float:
    """Tokens/s if every decode step only had to read the weights once and each sequence's K/V once."""
    head_dim = config.hidden_size // config.num_attention_heads
    weight_bytes = 2 * sum(
        [
            config.vocab_size * config.hidden_size * 2,  # embedding + LM head
            config.num_hidden_layers
            * (
                config.hidden_size * head_dim * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)
                + 3 * config.hidden_size * config.intermediate_size
            ),
        ]
    )
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2
    step_bytes = weight_bytes + batch * mean_context * kv_bytes_per_token
    return batch / (step_bytes / (gbs * 1e9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device; nothing to measure")
        return

    config = transformers.LlamaConfig(**LLAMA3_8B, architectures=["LlamaForCausalLM"])
    folder = Path(tempfile.mkdtemp(prefix="llama3-8b-shape-"))
    config.save_pretrained(folder)
    save_placeholder_tokenizer(folder)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 30000, (args.num_requests, args.prompt_len), generator=gen).tolist()

    llm = LLM(
        model=str(folder),
        load_format="dummy",
        dtype="bfloat16",
        max_num_seqs=args.num_requests,
        max_num_batched_tokens=8192,
        enforce_eager=args.enforce_eager,
    )
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ours = args.num_requests * args.output_len / seconds
    graphs = llm.engine.runner.decode_graphs
    gbs = copy_bandwidth_gbs()
    bound = decode_bound_tokens_per_s(config, args.num_requests, args.prompt_len + args.output_len / 2, gbs)
    report = {
        "gpu": torch.cuda.get_device_name(),
        "pagedserve_output_tok_s": ours,
        "seconds": seconds,
        "copy_bandwidth_gbs": gbs,
        "decode_bound_tok_s": bound,
        "share_of_bound": ours / bound,
        "decode_graph_sizes": graphs.batch_sizes if graphs else "off",
        "decode_graph_replays": graphs.num_replays if graphs else 0,
    }
    del llm
    torch.cuda.empty_cache()
    if not args.skip_transformers:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
        generation = transformers.GenerationConfig(
            max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False, eos_token_id=None
        )
        start = time.perf_counter()
        outputs = model.generate_batch(prompts, generation_config=generation)
        torch.cuda.synchronize()
        hf_seconds = time.perf_counter() - start
        report["transformers_output_tok_s"] = sum(len(o.generated_tokens) for o in outputs.values()) / hf_seconds
        report["speedup_vs_transformers"] = ours / report["transformers_output_tok_s"]
    for key, value in report.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
