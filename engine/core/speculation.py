"""Verifying proposed tokens (speculative decoding) from the target model's logits at every proposed position.

A sequence that proposed k tokens x_1..x_k was run with its last known token and the k proposals, so the
target's logits rows 0..k give its distribution after the known tokens, after x_1, ..., after x_k. Row i is
processed as the sampler would process it had x_1..x_i been sampled (penalties count them, min_tokens sees
them); then:

- greedy: x_i is accepted while it equals row i-1's argmax; the first argmax that differs (or row k's, when
  every proposal was accepted) follows. The output is the one greedy decoding gives, token for token.
- sampling: x_i is accepted with probability p_{i-1}(x_i), the target's probability (the proposal is a point
  mass: an n-gram proposer is deterministic); at the first rejection the token is drawn from p_{i-1} without
  x_i, renormalized (max(0, p - q) normalized), and with every proposal accepted one more from p_k. Each token
  is then distributed exactly as the target's (Leviathan et al. 2023, Chen et al. 2023); a seeded request draws
  its uniforms and its token from its own generator, so it repeats itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from pagedserve.engine.core.sampler import apply_logit_processors, draw, target_probs
from pagedserve.engine.scheduling.request import Request


class AtPosition:
    """A request as it stands `accepted` proposals later: the fields the logit processors read."""

    def __init__(self, request: Request, accepted: list[int]) -> None:
        self.params = request.params
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids = request.output_token_ids + accepted
        self.num_output_tokens = len(self.output_token_ids)
        self.stop_token_ids = request.stop_token_ids
        self.eos_token_ids = request.eos_token_ids
        self.generator = request.generator
        self.grammar = None  # constrained requests do not speculate


def positions(request: Request, drafts: list[int]) -> list[Request]:
    """One view of the request per verified row (typed as Request: the processors read only these fields)."""
    return cast(list[Request], [AtPosition(request, drafts[:i]) for i in range(len(drafts) + 1)])


def processed_rows(logits: torch.Tensor, request: Request, drafts: list[int]) -> torch.Tensor:
    """The request's rows with its logit_bias, min_tokens and penalties applied position by position."""
    params = request.params
    if not (params.logit_bias or params.needs_penalties or request.num_output_tokens < params.min_tokens):
        return logits
    return apply_logit_processors(logits, positions(request, drafts))


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """The accepted proposals and the target's next token, from processed rows [len(drafts) + 1, vocab]."""
    targets = logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return drafts[:accepted] + [targets[accepted]]


def verify_sampled(logits: torch.Tensor, request: Request, drafts: list[int]) -> list[int]:
    """Rejection sampling against a deterministic proposal, from processed rows [len(drafts) + 1, vocab]."""
    views = positions(request, drafts)
    probs = target_probs(logits, views)
    rows = torch.arange(len(drafts), device=probs.device)
    proposed = torch.tensor(drafts, device=probs.device)
    uniforms = torch.rand(len(drafts), generator=request.generator).to(probs.device)
    rejected = (uniforms >= probs[rows, proposed]).tolist()
    accepted = rejected.index(True) if True in rejected else len(drafts)
    final = probs[accepted : accepted + 1]
    if accepted < len(drafts):
        residual = final.clone()
        residual[0, drafts[accepted]] = 0.0
        if float(residual.sum()) > 0:  # else p(x) rounded to 1: x itself is the only token left to draw
            final = residual
    token = int(draw(final, [views[accepted]])[0])
    return drafts[:accepted] + [token]


def verify(logits: torch.Tensor, request: Request, drafts: Sequence[int]) -> list[int]:
    """The tokens a request keeps from its verified rows: accepted proposals, then one of the target's."""
    drafts = list(drafts)
    rows = processed_rows(logits, request, drafts)
    if request.params.is_greedy:
        return verify_greedy(rows, drafts)
    return verify_sampled(rows, request, drafts)
