"""Which projections could take 8-bit activations: teacher forcing with chosen projections' inputs rounded.

benchmarks/teacher_forcing.py serves the integer paths end to end: 8 bits everywhere misses issue 33's targets
(top-1 agreement >= 99.5%, mean |logprob difference| <= 0.02) on the embedded SmolLM2, 16 bits meets them. 8-bit
products run at twice the 16-bit ones' rate on AVX2 (32 products an instruction instead of 16), so a mix would pay
if some projections tolerated 8 bits. This measures each projection class alone: transformers' float32 model of
the same file, with the selected Linear layers' inputs rounded as q8_activations.c rounds them (a float scale
per 32 features, d = max |x| / 127 or / Q16_MAX, to the nearest integer) and every other projection's to 16 bits,
as a mixed path would serve them.

One forward per prompt over the prompt and the float32 path's 128 greedy tokens is the teacher forcing: the
prompt's positions stay float32 (prefill in serving) and every later position is a decode step's input. Each
position's top-1 token is compared with the unrounded forward's, and the float32 path's token's logprob with the
unrounded one (the first generated token comes from the prompt's last position: float32, as in serving).

    python -m benchmarks.activation_sensitivity [--prompts 64] [--tokens 128]
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AutoModelForCausalLM

from benchmarks.quantized_linear import cpu_model
from benchmarks.teacher_forcing import generate
from benchmarks.workloads import chat_prompts
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.worker.model_loader import load_model
from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path

INT8_MAX, INT16_MAX = 127, 32639  # int8_activations.h's ranges (Q16_MAX)
QKV, OUT, GATE_UP, DOWN = ("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)
LAYERS = QKV + OUT + GATE_UP + DOWN
# (name, projections at 8 bits, the head's range, features a scale): the other layer projections at 16 bits.
MIXES: tuple[tuple[str, tuple[str, ...], int, int], ...] = (
    ("16 bits everywhere (served `auto`)", (), INT16_MAX, 32),
    ("8 bits everywhere (served `int8`)", LAYERS, INT8_MAX, 32),
    ("8 bits everywhere, a scale per 16 features", LAYERS, INT8_MAX, 16),
    ("8 bits in every layer projection, head 16", LAYERS, INT16_MAX, 32),
    ("8 bits in q/k/v and gate/up (inputs straight from a norm)", QKV + GATE_UP, INT16_MAX, 32),
    ("8 bits in q/k/v only", QKV, INT16_MAX, 32),
    ("8 bits in o only", OUT, INT16_MAX, 32),
    ("8 bits in gate/up only", GATE_UP, INT16_MAX, 32),
    ("8 bits in down only", DOWN, INT16_MAX, 32),
)


def rounded(x: torch.Tensor, largest: int, features: int) -> torch.Tensor:
    """x rounded to integers of at most `largest` a block of `features`, and scaled back."""
    blocks = x.reshape(-1, features)
    scale = blocks.abs().amax(dim=1, keepdim=True) / largest
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return (torch.round(blocks * inverse) * scale).reshape(x.shape)


@contextmanager
def rounded_inputs(
    model: torch.nn.Module, ranges: dict[str, int], features: int, first_position: list[int]
) -> Iterator[None]:
    """Rounds each Linear's input at positions from first_position[0] on, `features` a scale, to the range its
    name's last part maps to in `ranges` ("lm_head" for the head)."""

    def hook_for(largest: int) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], tuple[torch.Tensor]]:
        def round_decode_positions(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
            x, start = args[0].clone(), first_position[0]
            x[:, start:] = rounded(x[:, start:], largest, features)
            return (x,)

        return round_decode_positions

    handles = [
        module.register_forward_pre_hook(hook_for(ranges[name.rsplit(".", 1)[-1]]))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ranges
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def forced_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int], first: list[int]) -> torch.Tensor:
    """Log-probabilities at the positions that chose `tokens` (the prompt's last and each decode step's)."""
    first[0] = len(prompt)
    ids = torch.tensor([prompt + tokens[:-1]])
    return torch.log_softmax(model(ids).logits[0, len(prompt) - 1 :].float(), dim=-1)


@torch.inference_mode()
def scores(
    model: torch.nn.Module,
    prompts: list[list[int]],
    generated: list[list[int]],
    ranges: dict[str, int],
    features: int,
    reference: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[float, float, float]:
    """(top-1 agreement with the unrounded forward, mean and largest |logprob difference| of the forced token)."""
    first = [0]
    agrees, differences = [], []
    with rounded_inputs(model, ranges, features, first):
        for prompt, tokens, (top1, chosen) in zip(prompts, generated, reference, strict=True):
            logprobs = forced_logprobs(model, prompt, tokens, first)
            agrees.append(logprobs.argmax(dim=-1) == top1)
            differences.append((logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0] - chosen).abs())
    agree, difference = torch.cat(agrees).float(), torch.cat(differences)
    return agree.mean().item(), difference.mean().item(), difference.max().item()


@torch.inference_mode()
def unrounded(model: torch.nn.Module, prompts: list[list[int]], generated: list[list[int]]) -> list:
    """Per prompt: the unrounded forward's top-1 tokens and the forced tokens' logprobs."""
    reference = []
    for prompt, tokens in zip(prompts, generated, strict=True):
        logprobs = forced_logprobs(model, prompt, tokens, [len(prompt)])
        reference.append((logprobs.argmax(dim=-1), logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]))
    return reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    started, clock = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
    loaded = load_model(EngineConfig())
    prompts = chat_prompts(loaded.tokenizer, args.prompts, 20, 400)
    generated = [tokens for tokens, _ in generate(loaded, prompts, args.tokens)]
    path = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    reference = unrounded(model, prompts, generated)
    rows = []
    for name, eight_bit, head, features in MIXES:
        ranges = {part: INT8_MAX if part in eight_bit else INT16_MAX for part in LAYERS} | {"lm_head": head}
        rows.append((name, *scores(model, prompts, generated, ranges, features, reference)))
    print(f"{cpu_model()}, {os.cpu_count()} cores; {started:%Y-%m-%d %H:%M} UTC; {time.perf_counter() - clock:.0f} s")
    print(f"embedded SmolLM2, transformers float32 with rounded projection inputs; {len(prompts)} chat prompts x "
          f"{args.tokens} forced tokens\n")  # fmt: skip
    print("| activations | top-1 agreement (>= 99.5%) | mean abs logprob difference (<= 0.02) | largest |")
    print("|---|---:|---:|---:|")
    for name, agreement, mean, largest in rows:
        print(f"| {name} | {agreement:.2%} | {mean:.4f} | {largest:.3f} |")


if __name__ == "__main__":
    main()
