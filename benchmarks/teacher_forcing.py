"""How far 8- and 16-bit activations move the embedded SmolLM2's tokens: teacher forcing against float32.

The float32 path (activation_dtype float32) generates 128 greedy tokens for each of 64 chat prompts (the
throughput benchmark's workload) and keeps each chosen token's logprob. The int8 path (then int16) serves the same
prompts as it would any request, but its sampler is made to pick the float32 path's token at each step, so
both paths see the same text; it records, at each generated position, whether its own top-1 token is the float32
path's and the absolute difference of the two paths' logprobs of that token. Targets (issue 33): agreement >=
99.5%, mean difference <= 0.02.

Requests run in waves of 15 streams, and every step of fewer than 16 tokens takes integer activations (the
benchmark raises kernels/quantized.py's INTEGER_MAX_TOKENS to 16 for its run: each token's arithmetic on that path
is its own, whatever else shares the step, so a wave of 15 computes what 15 single streams would, only faster);
prompts prefill in float32, as they do in serving, and so does the first generated token, which comes from the
prefill step. A control runs the same way on float32 activations: what the method alone contributes (float32
rounding of a differently batched forward).

--llama-server runs the same check on llama.cpp serving the same file (its activations quantized to 8 bits as
ggml does, its KV cache in float16 as by default): one completion of one token per position, its prompt the
chat prompt and the forced tokens so far (reused from its cache), scored from the logprobs it returns. There
every position, the first included, comes from llama.cpp's own arithmetic.

    python -m benchmarks.teacher_forcing [--prompts 64] [--tokens 128] [--no-control] [--activations int8,int16]
                                         [--llama-server /tmp/llama-server]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the engine sets it (engine/openmp_policy.py)

import httpx
import torch

from benchmarks.gguf_side_by_side import llama_server
from benchmarks.quantized_linear import cpu_model
from benchmarks.workloads import chat_prompts
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.core.sampler import SamplerOutput
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduling.request import Request
from pagedserve.engine.worker.model_loader import LoadedModel, load_model
from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path
from pagedserve.kernels import quantized

WAVE = 15  # streams at once: their decode steps take integer activations (see FORCED_MAX_TOKENS)
FORCED_MAX_TOKENS = 16
PEER_TOP = 20  # logprobs llama-server returns a position: the forced token is nearly always among them
Generated = list[tuple[list[int], list[float]]]  # per prompt: tokens, their logprobs


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[int, list]:
    """Every request's deltas, by index."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    deltas: dict[int, list] = {i: [] for i in range(len(requests))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            deltas[int(delta.request_id)].append(delta)
    return deltas


def generate(loaded: LoadedModel, prompts: list[list[int]], tokens: int) -> Generated:
    """The float32 path's greedy tokens and their logprobs."""
    engine = LLMEngine(EngineConfig(activation_dtype="float32", enable_prefix_caching=False), loaded=loaded)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=0, detokenize=False)
    out = []
    for deltas in run(engine, [(prompt, params) for prompt in prompts]).values():
        ids = [t for d in deltas for t in d.new_token_ids]
        out.append((ids, [entry.logprob for d in deltas for entry in d.new_logprobs or []]))
    return out


class ForcingSampler:
    """Picks the float32 path's token for every request, recording how this path's logits score it."""

    def __init__(self, forced: dict[str, tuple[list[int], list[float]]]) -> None:
        self.forced = forced
        self.results: list[tuple[bool, float]] = []  # (top-1 agrees, |logprob difference|) per position

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        best = logprobs.argmax(dim=-1).tolist()
        tokens = []
        for row, request in enumerate(requests):
            ids, expected = self.forced[request.request_id]
            token, position = ids[request.num_output_tokens], request.num_output_tokens
            self.results.append((best[row] == token, abs(float(logprobs[row, token]) - expected[position])))
            tokens.append(token)
        return SamplerOutput(tokens, [None] * len(requests))


def forced_scores(
    loaded: LoadedModel, prompts: list[list[int]], generated: Generated, activation_dtype: str
) -> list[tuple[bool, float]]:
    """(top-1 agrees, |logprob difference|) at every generated position, served on `activation_dtype` in waves
    of WAVE streams with the float32 path's tokens forced."""
    config = EngineConfig(activation_dtype=activation_dtype, max_num_seqs=WAVE, enable_prefix_caching=False)
    engine = LLMEngine(config, loaded=loaded)
    sampler = ForcingSampler({str(i): out for i, out in enumerate(generated)})
    engine.sampler = sampler  # type: ignore[assignment]
    tokens = len(generated[0][0])
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    for wave in range(0, len(prompts), WAVE):
        for i in range(wave, min(wave + WAVE, len(prompts))):
            engine.add_request(str(i), prompts[i], params)
        while engine.has_unfinished_requests():
            engine.step()
    return sampler.results


def llama_server_scores(binary: str, prompts: list[list[int]], generated: Generated) -> list[tuple[bool, float]]:
    """(top-1 agrees, |logprob difference|) at every generated position on llama-server serving the embedded file
    (2 threads), fed the float32 path's tokens. A forced token outside its top PEER_TOP (printed) is scored at the
    last of them: a bound on its logprob."""
    results, outside = [], 0
    with tempfile.TemporaryDirectory() as logs:
        server = llama_server(binary, embedded_gguf_path(), threads=2, streams=1, log=Path(logs) / "llama.log")
        with server, httpx.Client(timeout=60) as client:
            server.wait_ready()
            url = server.ready_url.rsplit("/", 1)[0] + "/completion"
            for prompt, (ids, expected) in zip(prompts, generated, strict=True):
                for position, token in enumerate(ids):
                    body = {"prompt": prompt + ids[:position], "n_predict": 1, "n_probs": PEER_TOP,
                            "temperature": 0, "cache_prompt": True}  # fmt: skip
                    response = client.post(url, json=body)
                    response.raise_for_status()
                    top = response.json()["completion_probabilities"][0]["top_logprobs"]
                    logprobs = {entry["id"]: entry["logprob"] for entry in top}
                    outside += token not in logprobs
                    logprob = logprobs.get(token, top[-1]["logprob"])
                    results.append((top[0]["id"] == token, abs(logprob - expected[position])))
    print(f"llama-server: {outside} of {len(results)} forced tokens outside its top {PEER_TOP}")
    return results


def summary(results: list[tuple[bool, float]]) -> tuple[float, float, float]:
    """(top-1 agreement, mean |difference|, largest |difference|)."""
    return (
        sum(agrees for agrees, _ in results) / len(results),
        statistics.fmean(diff for _, diff in results),
        max(diff for _, diff in results),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=20)
    parser.add_argument("--max-prompt", type=int, default=400)
    parser.add_argument("--no-control", action="store_true", help="skip the float32 control")
    parser.add_argument("--activations", default="int8,int16", help="the integer paths to check (comma list)")
    parser.add_argument("--llama-server", help="also check llama.cpp's server binary on the same file")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    quantized.INTEGER_MAX_TOKENS.update(int8=FORCED_MAX_TOKENS, int16=FORCED_MAX_TOKENS)  # see the docstring
    loaded = load_model(EngineConfig())
    prompts = chat_prompts(loaded.tokenizer, args.prompts, args.min_prompt, args.max_prompt)
    clock = time.perf_counter()
    generated = generate(loaded, prompts, args.tokens)
    paths = [dtype for dtype in args.activations.split(",") if dtype]
    rows = {dtype: summary(forced_scores(loaded, prompts, generated, dtype)) for dtype in paths}
    if not args.no_control:
        rows["float32 (control)"] = summary(forced_scores(loaded, prompts, generated, "float32"))
    if args.llama_server:
        peer = llama_server_scores(args.llama_server, prompts, generated)
        rows["llama-server (ggml's 8-bit activations)"] = summary(peer)
    positions = sum(len(ids) for ids, _ in generated)
    print(f"{cpu_model()}, {os.cpu_count()} cores; {started:%Y-%m-%d %H:%M} UTC; {time.perf_counter() - clock:.0f} s")
    print(f"embedded SmolLM2 (Q4_1 layers, Q8_0 head); {len(prompts)} chat prompts of {min(map(len, prompts))}-")
    print(f"{max(map(len, prompts))} tokens; {positions} positions of the float32 path's greedy tokens\n")
    print("| activations, forced | top-1 agreement | mean abs logprob difference | largest |")
    print("|---|---:|---:|---:|")
    for name, (agreement, mean, largest) in rows.items():
        print(f"| {name} | {agreement:.2%} | {mean:.4f} | {largest:.3f} |")


if __name__ == "__main__":
    main()
