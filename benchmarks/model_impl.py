"""What the transformers fallback costs: one Llama served by our own model and by transformers' modules with
paged attention (model_impl native / transformers), output tokens/s at 1 and 32 streams.

    python -m benchmarks.model_impl                    # a random Llama: hidden 512, 8 layers, 8 heads / 4 KV heads
    python -m benchmarks.model_impl --model DIR        # any Llama-family checkpoint (or .gguf file)

Each row runs greedy requests through LLMEngine in this process (float32 on the CPU, bfloat16 on CUDA), after
one warm-up request; both implementations run the same weights, so they must also give the same tokens.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as engine/__init__.py does, but torch loads first here

import torch

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams

LLAMA = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    vocab_size=49152,  # the SmolLM2 tokenizer's
    tie_word_embeddings=True,
)


def random_llama(folder: Path) -> Path:
    """LLAMA with random weights and the embedded SmolLM2's tokenizer, saved to `folder`."""
    import transformers

    from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path
    from pagedserve.engine.worker.weights.gguf_files import gguf_model_dir

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA, initializer_range=0.2, eos_token_id=2, bos_token_id=1)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(gguf_model_dir(embedded_gguf_path())).save_pretrained(folder)
    return folder


def run(engine: LLMEngine, streams: int, prompt_len: int, output_len: int) -> tuple[float, list[list[int]]]:
    """Seconds for `streams` requests at once, and their tokens."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        engine.add_request(str(i), list(range(1000 + 97 * i, 1000 + 97 * i + prompt_len)), params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(streams)}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
    return time.perf_counter() - start, [tokens[str(i)] for i in range(streams)]


def measure(model: str, impl: str, streams: int, args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    config = EngineConfig(model=model, model_impl=impl, engine_process=False, activation_dtype="float32")
    engine = LLMEngine(config)
    try:
        run(engine, 1, args.prompt_len, 4)  # warm-up: kernels built, caches touched
        seconds, tokens = run(engine, streams, args.prompt_len, args.output_len)
    finally:
        engine.close()
    return streams * args.output_len / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Llama-family checkpoint (default: a random Llama, see LLAMA)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or str(random_llama(Path(scratch)))
        threads = torch.get_num_threads()
        print(f"threads {threads}, prompts of {args.prompt_len} tokens, {args.output_len} output tokens each")
        print("| streams | native tok/s | transformers fallback tok/s | fallback / native | same tokens |")
        print("|---:|---:|---:|---:|---|")
        for streams in args.streams:
            native, native_tokens = measure(model, "native", streams, args)
            fallback, fallback_tokens = measure(model, "transformers", streams, args)
            same = "yes" if native_tokens == fallback_tokens else "no"
            print(f"| {streams} | {native:.1f} | {fallback:.1f} | {fallback / native:.2f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
