"""Speculative decoding in the step: which sequences propose, where their rows are, what they keep.

Before scheduling, each decoding sequence that may speculate gets up to k proposed tokens (engine/speculative/);
the scheduler gives those that fit the token budget and the KV cache 1 + k query tokens; the runner returns a
logits row for the last known token and for each proposal; `verify_all` keeps what the target agrees with
(engine/core/speculation.py) and the scheduler rolls the rest back.

Not every sequence speculates: requests with a structured-output constraint (the grammar would have to follow
every proposed position) or logprobs, and every sequence in a step whose running batch times (k + 1) exceeds
the token budget, where a forward is bound by compute rather than by reading the weights and extra query tokens
cost about what they compute. A sequence whose proposals were all rejected proposes again only after 1, 2, then
4 decoding steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.speculation import verify
from pagedserve.engine.scheduling.request import Request
from pagedserve.engine.scheduling.scheduler import ScheduledRequest
from pagedserve.engine.speculative.draft import DraftModelProposer
from pagedserve.engine.speculative.ngram import NgramProposer
from pagedserve.engine.speculative.proposer import Proposer
from pagedserve.engine.worker import LoadedModel

logger = logging.getLogger(__name__)
MAX_PAUSE_STEPS = 4  # after proposals rejected outright, steps without any: 1, 2, 4, 4, ... in a row


@dataclass
class SpeculationStats:
    """Counters as vLLM names them: drafts (sequences that verified proposals), tokens proposed, accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose proposal i was accepted

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position += [0] * (num_proposed - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


def _pausing(request: Request) -> bool:
    """Whether the sequence skips proposing this step (counting the step down)."""
    if request.speculation_pause > 0:
        request.speculation_pause -= 1
        return True
    return False


def _note_outcome(request: Request, accepted: int) -> None:
    """A sequence whose proposals keep being rejected outright (text the proposer cannot guess) proposes less
    often: each wasted verification costs its rows' compute, which on the CPU's block formats is close to a
    decode step per row."""
    if accepted > 0:
        request.speculation_misses = 0
        return
    request.speculation_misses += 1
    request.speculation_pause = min(2 ** (request.speculation_misses - 1), MAX_PAUSE_STEPS)


def make_proposer(config: EngineConfig, target: LoadedModel, num_target_blocks: int) -> Proposer | None:
    if config.speculative_method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max, config.num_speculative_tokens)
    if config.speculative_method == "draft":
        return DraftModelProposer(config, target, num_target_blocks)
    return None


class Speculator:
    def __init__(self, config: EngineConfig, max_model_len: int, proposer: Proposer | None) -> None:
        self.proposer = proposer
        self.following: set[str] = set()  # the running sequences at the last round (the proposer may hold state)
        self.num_tokens = config.num_speculative_tokens
        self.token_budget = config.max_num_batched_tokens
        self.default = config.speculative_default
        self.max_model_len = max_model_len
        self.stats = SpeculationStats()  # since collect_stats last reset them (benchmarks)
        self.totals = SpeculationStats()  # since the start (metrics)

    def propose(self, running: list[Request]) -> dict[str, list[int]]:
        """Proposed next tokens by sequence id, for the running sequences that speculate this step."""
        if self.proposer is None:
            return {}
        self.follow(running)
        if len(running) * (self.num_tokens + 1) > self.token_budget:
            return {}
        candidates = [r for r in running if self._speculates(r) and not _pausing(r)]
        # Room for the proposals and the target's token after them, within max_tokens and the context.
        limits = [
            min(self.num_tokens, r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1)
            for r in candidates
        ]
        drafts = self.proposer.propose(candidates, limits)
        return {r.request_id: d for r, d in zip(candidates, drafts) if d}

    def follow(self, running: list[Request]) -> None:
        """Lets the proposer drop what it holds for sequences no longer running (finished, aborted, preempted)."""
        if self.proposer is None:
            return
        running_ids = {r.request_id for r in running}
        if self.following - running_ids:
            self.proposer.release(self.following - running_ids)
        self.following = running_ids

    def _speculates(self, request: Request) -> bool:
        params = request.params
        wanted = self.default if params.speculative is None else params.speculative
        return (
            wanted
            and request.num_output_tokens > 0
            and request.num_computed_tokens == request.num_tokens - 1
            and params.structured_output is None
            and request.grammar is None
            and params.logprobs is None
        )

    def verify_all(
        self, items: list[ScheduledRequest], logits: list[torch.Tensor]
    ) -> tuple[dict[str, list[int]], dict[str, str]]:
        """Each verifying sequence's kept tokens, and the callers' ids of requests whose verification failed."""
        verified: dict[str, list[int]] = {}
        failed: dict[str, str] = {}
        for item, rows in zip(items, logits):
            request = item.request
            try:
                tokens = verify(rows, request, item.draft_token_ids)
            except Exception as exc:
                logger.exception("request %s: verifying proposals failed; failing it", request.parent_id)
                failed[request.parent_id] = f"sampling failed: {exc}"
                continue
            verified[request.request_id] = tokens
            _note_outcome(request, accepted=len(tokens) - 1)
            for stats in (self.stats, self.totals):
                stats.record(len(item.draft_token_ids), len(tokens) - 1)
        return verified, failed


def split_rows(
    logits: torch.Tensor, scheduled: list[ScheduledRequest]
) -> tuple[torch.Tensor, list[ScheduledRequest], list[torch.Tensor]]:
    """The runner's sampling rows split into one row per plain sampling sequence, and 1 + k rows per
    verifying sequence (in scheduling order; see ModelRunner's _sampling_rows)."""
    sampling = [s for s in scheduled if s.samples]
    if not any(s.draft_token_ids for s in sampling):
        return logits, [], []
    plain: list[int] = []
    verifying: list[ScheduledRequest] = []
    blocks: list[torch.Tensor] = []
    row = 0
    for item in sampling:
        size = 1 + len(item.draft_token_ids)
        if item.draft_token_ids:
            verifying.append(item)
            blocks.append(logits[row : row + size])
        else:
            plain.append(row)
        row += size
    return logits[torch.tensor(plain, dtype=torch.long, device=logits.device)], verifying, blocks
