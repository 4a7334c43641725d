"""Tensor parallelism on the CPU: where a step's time goes at TP=1, 2 and 3, and what carrying a step costs.

    python -m benchmarks.tensor_parallel                 # a SmolLM2-sized model at TP=1/2/3 (float32, gloo)
    python -m benchmarks.tensor_parallel --channel       # broadcasting a step's inputs: tensors vs pickled
    python -m benchmarks.tensor_parallel --quantization q8_0                 # the projections in blocks
    python -m benchmarks.tensor_parallel --model SmolLM2.gguf --quantization auto --sizes 1 3   # a GGUF's blocks

The first table runs one offline workload through LLMEngine at each size, every rank on one torch thread, and
reports the step time and the share rank 0 spends in collectives (all-reduces, the embedding's and the LM
head's gathers). SmolLM2 itself splits over 1 or 3 ranks only (9 heads, 3 KV heads), so the default model is
SmolLM2's shape with 12 heads of 48 and 6 KV heads, random weights (timing does not depend on them). On a
2-core machine three ranks share two cores, so TP>1 measures what communication costs, not a speed-up.
`--quantization` keeps each rank's projections in a block format: quantized at load (random weights), or with
`auto` the stored blocks of the GGUF file `--model` names (its weights are read, not random).

The second compares the two ways of sending a step to the other ranks (engine/worker/distributed/commands.py): two
broadcasts of int64 tensors, or a pickled batch (what `broadcast_object_list` does: a size, then the bytes),
each followed by the receivers rebuilding the batch.
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as engine/__init__.py does, but torch loads first here

import torch

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
from pagedserve.engine.config import QUANTIZATIONS
from pagedserve.engine.worker.distributed.commands import Command, receive_command, send_command
from pagedserve.engine.worker.distributed.group import TensorParallelGroup
from pagedserve.engine.worker.distributed.rendezvous import Rendezvous, connect_store, join_group, open_master_store
from pagedserve.engine.worker.model_runner import HostBatch

CPU = torch.device("cpu")


def smollm2_shaped_model(folder: Path) -> Path:
    """SmolLM2-135M's sizes, with heads that split over 2 and 3 ranks; config and tokenizer only."""
    import transformers

    from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path
    from pagedserve.engine.worker.weights.gguf_files import dequantized_model_dir

    smol = dequantized_model_dir(embedded_gguf_path())
    config = transformers.AutoConfig.from_pretrained(smol)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 12, 6, 48
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(smol).save_pretrained(folder)
    return folder


def engine_table(
    model: str, sizes: list[int], num_requests: int, prompt_len: int, output_len: int, quantization: str
) -> None:
    print("| TP | steps | step ms | forward ms | communication ms | share of step | output tok/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for size in sizes:
        config = EngineConfig(
            model=model,
            load_format="auto" if quantization == "auto" else "dummy",  # stored blocks are read from the file
            tensor_parallel_size=size,
            num_threads=1,
            quantization=quantization,
            num_kv_blocks=512,
        )
        engine = LLMEngine(config)
        try:
            for i in range(num_requests):
                engine.add_request(str(i), list(range(1000 + 97 * i, 1000 + 97 * i + prompt_len)), params)
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            seconds = time.perf_counter() - start
            stats = engine.collect_stats()
        finally:
            engine.close()
        step_ms = 1000 * stats.step_seconds / stats.num_steps
        forward_ms = 1000 * stats.forward_seconds / stats.num_steps
        comm_ms = 1000 * stats.communication_seconds / stats.num_steps
        share = stats.communication_seconds / stats.step_seconds
        rate = stats.generation_tokens / seconds
        row = f"| {size} | {stats.num_steps} | {step_ms:.1f} | {forward_ms:.1f} | {comm_ms:.1f} | {share:.0%} |"
        print(f"{row} {rate:.1f} |", flush=True)


# ---- the step channel ----------------------------------------------------------------------------------


def sample_batch(num_seqs: int, tokens_per_seq: int, blocks_per_seq: int) -> HostBatch:
    num_tokens = num_seqs * tokens_per_seq
    lens = [blocks_per_seq * 16] * num_seqs
    return HostBatch(
        input_ids=torch.arange(num_tokens),
        positions=torch.arange(num_tokens),
        slot_mapping=torch.arange(num_tokens),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.arange(0, num_tokens + 1, tokens_per_seq, dtype=torch.int32),
        block_tables=torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(num_seqs, -1),
        logits_indices=torch.arange(tokens_per_seq - 1, num_tokens, tokens_per_seq),
        query_lens_host=[tokens_per_seq] * num_seqs,
        seq_lens_host=lens,
    )


def send_pickled(group: TensorParallelGroup, batch: HostBatch) -> None:
    payload = torch.frombuffer(bytearray(pickle.dumps(batch)), dtype=torch.uint8)
    group.broadcast_host(torch.tensor([len(payload)]))
    group.broadcast_host(payload)


def receive_pickled(group: TensorParallelGroup) -> HostBatch:
    size = int(group.broadcast_host(torch.zeros(1, dtype=torch.int64)))
    payload = group.broadcast_host(torch.empty(size, dtype=torch.uint8))
    return pickle.loads(payload.numpy().tobytes())


CASES = {"decode, 8 sequences": (8, 1, 8), "decode, 64 sequences": (64, 1, 16), "prefill, 4 x 512": (4, 512, 32)}
REPEATS = 300


def channel_round(group: TensorParallelGroup, way: str, batch: HostBatch | None) -> None:
    """One step sent (rank 0) or received and rebuilt (the others), then a 1-element all-reduce as a barrier."""
    if way == "tensors":
        if batch is not None:
            send_command(group, Command.STEP, batch.parts())
        else:
            HostBatch.from_parts(receive_command(group)[1])
    elif way == "pickled":
        if batch is not None:
            send_pickled(group, batch)
        else:
            receive_pickled(group)
    group.all_reduce(torch.zeros(1))


def channel_rounds(group: TensorParallelGroup, batch: HostBatch | None) -> dict[str, float]:
    """Seconds per round of each way (barrier-only rounds subtracted); the same calls on every rank."""
    seconds = {}
    for way in ("barrier", "tensors", "pickled"):
        for _ in range(20):
            channel_round(group, way, batch)
        start = time.perf_counter()
        for _ in range(REPEATS):
            channel_round(group, way, batch)
        seconds[way] = (time.perf_counter() - start) / REPEATS
    return {way: seconds[way] - seconds["barrier"] for way in ("tensors", "pickled")}


def channel_rank(rendezvous: Rendezvous, rank: int) -> None:
    torch.set_num_threads(1)
    group = join_group(connect_store(rendezvous), rank, rendezvous.world_size, CPU)
    for _ in CASES:
        channel_rounds(group, None)


def channel_table(sizes: list[int]) -> None:
    torch.set_num_threads(1)
    print("| ranks | step | tensors (ms) | pickled (ms) |")
    print("|---:|---|---:|---:|")
    for size in sizes:
        store, rendezvous = open_master_store(size)
        argv = [sys.executable, "-m", "benchmarks.tensor_parallel", "--channel-rank"]
        others = [
            subprocess.Popen([*argv, str(r), rendezvous.host, str(rendezvous.port), str(size)]) for r in range(1, size)
        ]
        group = join_group(store, 0, size, CPU)
        for name, shape in CASES.items():
            result = channel_rounds(group, sample_batch(*shape))
            print(f"| {size} | {name} | {1000 * result['tensors']:.3f} | {1000 * result['pickled']:.3f} |", flush=True)
        for process in others:
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--channel", action="store_true", help="time the step broadcast instead of the engine")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--model", help="a model directory (default: SmolLM2's shape, random weights)")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none", help="auto: a GGUF's blocks")
    parser.add_argument("--channel-rank", nargs=4, help=argparse.SUPPRESS)  # rank host port size: a helper rank
    args = parser.parse_args()
    if args.quantization == "auto" and not args.model:
        parser.error("--quantization auto multiplies a GGUF file's blocks: name the file with --model")
    if args.channel_rank:
        rank, host, port, size = args.channel_rank
        channel_rank(Rendezvous(host, int(port), int(size)), int(rank))
    elif args.channel:
        channel_table([s for s in args.sizes if s > 1])
    else:
        with tempfile.TemporaryDirectory() as folder:
            model = args.model or str(smollm2_shaped_model(Path(folder)))
            engine_table(model, args.sizes, args.num_requests, args.prompt_len, args.output_len, args.quantization)


if __name__ == "__main__":
    main()
