"""Turns the logits of the sampling rows into next tokens: processors, then greedy or random draws.

Every step is vectorised across rows; only per-request random generators are applied row by row, which is
what makes a seeded request reproducible whatever else shares its batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from pagedserve.engine.outputs import TokenLogprob
from pagedserve.engine.scheduling.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_logit_processors(logits, requests)
        tokens = _sample(logits, requests)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, tokens, requests)
        return SamplerOutput(token_list, logprobs)


def apply_logit_processors(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """allowed_token_ids, logit_bias, min_tokens (no stop before it) and repetition/frequency/presence penalties,
    on a copy:
    the engine may sample the same logits again (row by row, when a batch's sampling fails)."""
    if not any(_needs_processing(r) for r in requests):
        return logits
    logits = logits.clone()
    _keep_allowed_tokens(logits, requests)
    _apply_logit_bias(logits, requests)
    _block_stop_tokens_before_min(logits, requests)
    penalized = [i for i, r in enumerate(requests) if r.params.needs_penalties]
    if penalized:
        rows = torch.tensor(penalized, device=logits.device)
        logits[rows] = _apply_penalties(logits[rows], [requests[i] for i in penalized])
    return logits


def _needs_processing(request: Request) -> bool:
    params = request.params
    return (
        bool(params.logit_bias)
        or params.allowed_token_ids is not None
        or request.num_output_tokens < params.min_tokens
        or params.needs_penalties
    )


def _keep_allowed_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    """allowed_token_ids: every other token of the row to -inf (one masked row per such request)."""
    for row, request in enumerate(requests):
        allowed = request.params.allowed_token_ids
        if allowed is not None:
            keep = torch.tensor(allowed, device=logits.device)
            kept = logits[row, keep]
            logits[row] = float("-inf")
            logits[row, keep] = kept


def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> None:
    rows, cols, values = [], [], []
    for row, request in enumerate(requests):
        for token, bias in request.params.logit_bias.items():
            rows.append(row)
            cols.append(token)
            values.append(bias)
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits.index_put_(index, torch.tensor(values, device=device), accumulate=True)


def _block_stop_tokens_before_min(logits: torch.Tensor, requests: list[Request]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    for row, request in enumerate(requests):
        if request.num_output_tokens >= request.params.min_tokens:
            continue
        if request.grammar is not None and request.grammar.is_accepting():
            continue  # a complete constrained output may end: its constraint would refuse anything else
        stops = request.stop_token_ids
        if not request.params.ignore_eos:
            stops = stops | request.eos_token_ids
        rows.extend([row] * len(stops))
        cols.extend(stops)
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab_size] occurrence counts, built in one scatter."""
    counts = torch.zeros(len(token_lists), vocab_size, device=device)
    lengths = torch.tensor([len(t) for t in token_lists])
    if int(lengths.sum()) == 0:
        return counts
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    cols = torch.tensor(list(itertools.chain.from_iterable(token_lists)))
    counts.index_put_((rows.to(device), cols.to(device)), torch.ones(len(cols), device=device), accumulate=True)
    return counts


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    vocab, device = logits.shape[-1], logits.device
    output_counts = _token_counts([r.output_token_ids for r in requests], vocab, device)
    prompt_seen = _token_counts([r.prompt_token_ids for r in requests], vocab, device) > 0

    repetition = _column([r.params.repetition_penalty for r in requests], device)
    seen = prompt_seen | (output_counts > 0)
    # transformers' rule: shrink positive logits, grow negative ones, for every token seen so far.
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    logits -= _column([r.params.frequency_penalty for r in requests], device) * output_counts
    logits -= _column([r.params.presence_penalty for r in requests], device) * (output_counts > 0)
    return logits


def _sample(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        tokens[rows] = _sample_random(logits[rows], [requests[i] for i in random_rows])
    return tokens


def _sample_random(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    return draw(target_probs(logits, requests), requests)


def target_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The distribution each row's token is drawn from: temperature, then top-k / top-p / min-p."""
    temperature = _column([r.params.temperature for r in requests], logits.device)
    return _filter_top_k_top_p_min_p(logits / temperature, requests).softmax(dim=-1)


def draw(probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """One token a row from `probs` (rows need not sum to one); each seeded row uses its own stream."""
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
    noise = torch.empty_like(probs).exponential_()
    for row, request in enumerate(requests):
        if request.generator is not None:  # host generators: reproducible on any device
            noise[row] = torch.empty(noise.shape[1]).exponential_(generator=request.generator).to(noise.device)
    return (probs / noise).argmax(dim=-1)


def _filter_top_k_top_p_min_p(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    params = [r.params for r in requests]
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        min_p = _column([p.min_p for p in params], logits.device)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if not any(p.top_k > 0 or p.top_p < 1 for p in params):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    top_k = _column([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], logits.device)
    drop = torch.arange(vocab, device=logits.device).unsqueeze(0) >= top_k
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before > _column([p.top_p for p in params], logits.device)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _gather_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, requests: list[Request]
) -> list[TokenLogprob | None]:
    max_top = max(r.params.logprobs or 0 for r in requests)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    best = logprobs.topk(max_top, dim=-1) if max_top else (logprobs[:, :0], tokens[:, None][:, :0])
    top_values, top_ids = best[0].tolist(), best[1].tolist()
    token_list = tokens.tolist()
    result: list[TokenLogprob | None] = []
    for row, request in enumerate(requests):
        k = request.params.logprobs
        if k is None:
            result.append(None)
            continue
        top = list(zip(top_ids[row][:k], top_values[row][:k]))
        result.append(TokenLogprob(token_list[row], chosen[row], top))
    return result
