"""Speculative decoding in the step: which sequences propose, where their rows are, what they keep.

Before scheduling, each decoding sequence that may speculate gets up to k proposed tokens (engine/speculative/);
the scheduler gives those that fit the token budget and the KV cache 1 + k query tokens; the runner returns a
logits row for the last known token and for each proposal; `verify_all` keeps what the target agrees with
(engine/core/speculation.py) and the scheduler rolls the rest back.

Not every sequence speculates: requests with a structured-output constraint (the grammar would have to follow
every proposed position) or logprobs; and a step's k is turned down so that its running sequences x (k + 1) fit
the speculative token budget, then off (`token_budget`): past it a forward is bound by compute rather than by
reading the weights, and extra query tokens cost about what they compute. On the CPU's block formats that is
so from a few rows on (10 tokens: one or two sequences with k = 4), elsewhere from the step's token budget.
A sequence proposes only as many tokens as its recent acceptance says are worth verifying: where block formats
run on the CPU, by the measured cost of each step size (engine/core/step_costs.py: a query row more costs from a
tenth to most of a step there, by format, row count and CPU); elsewhere while a proposal's chance of acceptance
stays above MIN_ACCEPTANCE (`proposal_limit`). One whose proposals were all rejected proposes again only after 1,
2, then 4 decoding steps.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.speculation import verify
from pagedserve.engine.core.step_costs import EXPLORE_EVERY, StepCosts, plan_proposals
from pagedserve.engine.scheduling.request import Request
from pagedserve.engine.scheduling.scheduler import ScheduledRequest, SchedulerOutput
from pagedserve.engine.speculative.draft import DraftModelProposer
from pagedserve.engine.speculative.ngram import NgramProposer
from pagedserve.engine.speculative.proposer import Proposer
from pagedserve.engine.worker import LoadedModel

logger = logging.getLogger(__name__)
MAX_PAUSE_STEPS = 4  # after proposals rejected outright, steps without any: 1, 2, 4, 4, ... in a row
# Where step costs are not measured, a proposal is worth verifying while its chance of acceptance is at least
# this (on a GPU a row costs far less than a step: this is cautious).
MIN_ACCEPTANCE = 0.6
ACCEPTANCE_MEMORY = 0.7  # the weight of the acceptance seen before a verification, against that verification's
PRIOR_ACCEPTANCE, PRIOR_TRIALS = 0.9, 2.0  # a new sequence proposes 4 tokens: 0.9 ** 4 > MIN_ACCEPTANCE


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


def acceptance(request: Request) -> float:
    """The chance that the sequence's next proposal is accepted, from its recent verifications (and a prior)."""
    accepted = request.speculation_accepted + PRIOR_ACCEPTANCE * PRIOR_TRIALS
    return accepted / (request.speculation_trials + PRIOR_TRIALS)


def proposal_limit(request: Request, k: int) -> int:
    """How many proposals are worth verifying: the j-th is accepted only after the ones before it, with chance
    about a ** j, and pays while that is at least MIN_ACCEPTANCE. At least one (the pauses below throttle a
    sequence whose proposals keep failing, and its acceptance is learnt only by proposing)."""
    a = acceptance(request)
    worth = k if a >= 1 else int(math.log(MIN_ACCEPTANCE) / math.log(a)) if a > 0 else 0
    return max(1, min(k, worth))


def proposal_chances(request: Request, limit: int) -> list[float]:
    """The chance that each of the sequence's next `limit` proposals is kept, the ones before it kept too: the
    first is kept as often as its recent first proposals were; each later one as often as its recent proposals
    after a kept one were. Two rates, not one: a proposal that follows a kept one continues a copied run and is
    kept more often than a first one (prompt lookup on grounded text: 0.97 against 0.9), which one rate for all
    positions undervalues."""
    first = (request.speculation_first_kept + PRIOR_ACCEPTANCE * PRIOR_TRIALS) / (
        request.speculation_verifications + PRIOR_TRIALS
    )
    later = (request.speculation_continued + PRIOR_ACCEPTANCE * PRIOR_TRIALS) / (
        request.speculation_continuations + PRIOR_TRIALS
    )
    return [first * later**j for j in range(limit)]


def _note_outcome(request: Request, accepted: int, proposed: int) -> None:
    """A sequence whose proposals keep being rejected outright (text the proposer cannot guess) proposes less
    often: each wasted verification costs its rows' compute, which on the CPU's block formats is close to a
    decode step per row. Its acceptance estimate follows: accepted tokens, and trials (a rejection ends one)."""
    rejected = 1 if accepted < proposed else 0
    request.speculation_accepted = ACCEPTANCE_MEMORY * request.speculation_accepted + accepted
    request.speculation_trials = ACCEPTANCE_MEMORY * request.speculation_trials + accepted + rejected
    # proposal_chances' rates: the first proposal, and those verified after a kept one (all kept but the last
    # verified, which a rejection ends).
    request.speculation_first_kept = ACCEPTANCE_MEMORY * request.speculation_first_kept + (accepted > 0)
    request.speculation_verifications = ACCEPTANCE_MEMORY * request.speculation_verifications + 1
    after_kept = min(accepted + 1, proposed) - 1
    request.speculation_continued = ACCEPTANCE_MEMORY * request.speculation_continued + max(0, accepted - 1)
    request.speculation_continuations = ACCEPTANCE_MEMORY * request.speculation_continuations + after_kept
    if accepted > 0:
        request.speculation_misses = 0
        return
    request.speculation_misses += 1
    request.speculation_pause = min(2 ** (request.speculation_misses - 1), MAX_PAUSE_STEPS)


CPU_BLOCKS_TOKEN_BUDGET = 10  # the default speculative token budget where block formats run on the CPU


def token_budget(config: EngineConfig, target: LoadedModel) -> int:
    """The query tokens a speculating step may hold (EngineConfig.speculative_token_budget, or its default)."""
    if config.speculative_token_budget is not None:
        return config.speculative_token_budget
    if target.multiplies_blocks_on_cpu:
        return min(CPU_BLOCKS_TOKEN_BUDGET, config.max_num_batched_tokens)
    return config.max_num_batched_tokens


def step_costs(target: LoadedModel) -> StepCosts | None:
    """Measured step costs where a query row's cost varies most (block formats on the CPU); else None."""
    return StepCosts() if target.multiplies_blocks_on_cpu else None


def make_proposer(config: EngineConfig, target: LoadedModel, num_target_blocks: int) -> Proposer | None:
    if config.speculative_method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max, config.num_speculative_tokens)
    if config.speculative_method == "draft":
        return DraftModelProposer(config, target, num_target_blocks)
    return None


class Speculator:
    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        proposer: Proposer | None,
        budget: int,
        costs: StepCosts | None = None,
    ) -> None:
        """`budget`: the query tokens a speculating step may hold (token_budget()); `costs`: where given, how many
        proposals to verify follows the measured step costs (see step_costs.py), else MIN_ACCEPTANCE."""
        self.proposer = proposer
        self.costs = costs
        self.planned_steps = 0
        self.last_step_end: float | None = None
        self.following: set[str] = set()  # the running sequences at the last round (the proposer may hold state)
        self.num_tokens = config.num_speculative_tokens
        self.token_budget = budget
        self.default = config.speculative_default
        self.max_model_len = max_model_len
        self.stats = SpeculationStats()  # since collect_stats last reset them (benchmarks)
        self.totals = SpeculationStats()  # since the start (metrics)

    def propose(self, running: list[Request]) -> dict[str, list[int]]:
        """Proposed next tokens by sequence id, for the running sequences that speculate this step."""
        if self.proposer is None:
            return {}
        self.follow(running)
        k = min(self.num_tokens, self.token_budget // max(1, len(running)) - 1)  # (k + 1) x running fit the budget
        if k < 1:
            return {}
        candidates = [r for r in running if self._speculates(r) and not _pausing(r)]
        # Room for the proposals and the target's token after them, within max_tokens and the context.
        room = [
            min(k, r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1) for r in candidates
        ]
        if self.costs is not None:
            self.planned_steps += 1
            explore = self.planned_steps % EXPLORE_EVERY == 0
            chances = [proposal_chances(r, limit) for r, limit in zip(candidates, room)]
            limits = plan_proposals(chances, len(running), self.costs, explore)
        else:
            limits = [min(proposal_limit(r, k), limit) for r, limit in zip(candidates, room)]
        proposing = [(r, limit) for r, limit in zip(candidates, limits) if limit > 0]
        if not proposing:
            return {}
        drafts = self.proposer.propose([r for r, _ in proposing], [limit for _, limit in proposing])
        return {r.request_id: d for (r, _), d in zip(proposing, drafts) if d}

    def note_step(self, out: SchedulerOutput, start: float, end: float) -> None:
        """Records a decode-only step's cost by its query tokens (a step with a prompt's tokens costs more than
        its size says): from the previous step's end, since the loop around the steps (outputs handed on, the
        next inputs taken) is paid once a step too, but at most twice the step's own time (an idle engine's
        pause is not a cost)."""
        previous, self.last_step_end = self.last_step_end, end
        if self.costs is None or not all(s.num_new_tokens == 1 + len(s.draft_token_ids) for s in out.scheduled):
            return
        own = end - start
        cycle = own if previous is None else end - previous
        self.costs.record(out.num_batched_tokens, min(cycle, 2 * own))

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
            _note_outcome(request, accepted=len(tokens) - 1, proposed=len(item.draft_token_ids))
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
