"""Draft-model proposals: a smaller (or the same) model decodes k tokens greedily ahead of the target.

Each round runs k batched forwards of the draft over all proposing sequences together: the first catches the
draft's KV up on the tokens the target kept since the last round (accepted proposals and its own token; the
whole prompt for a new sequence) and proposes the first token, each next one feeds the previous proposal.
The draft's KV lives in its own paged cache (draft_blocks.py); a sequence's blocks follow it: they grow with
it, shrink back when proposals are rejected, and are freed when it leaves the running batch.

Proposals are greedy, a deterministic function of the sequence, so the core's verification against a point
mass (engine/core/speculation.py) keeps sampling exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.outputs import TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.speculative.draft_blocks import DraftBlocks
from pagedserve.engine.speculative.proposer import ProposalContext
from pagedserve.engine.worker import LoadedModel, load_draft_runner

_PARAMS = SamplingParams(max_tokens=1, temperature=0)


@dataclass
class DraftRow:
    """One sequence in a draft forward, in the shape the runner reads (its ScheduledSequence and state)."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    num_new_tokens: int
    params: SamplingParams = field(default_factory=lambda: _PARAMS)
    prompt_token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    draft_token_ids: tuple[int, ...] = ()
    samples: bool = True

    @property
    def request(self) -> DraftRow:
        return self


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target: LoadedModel, num_target_blocks: int) -> None:
        self.num_tokens = config.num_speculative_tokens
        # Room for every block the target can hold (the draft has no prefix sharing), plus each running
        # sequence's proposals past it.
        extra = config.max_num_seqs * (-(-self.num_tokens // config.block_size) + 1)
        self.blocks = DraftBlocks(num_target_blocks + extra, config.block_size)
        self.draft, self.runner = load_draft_runner(config, target, self.blocks, self.blocks.num_blocks)
        self.vocab_size = target.spec.vocab_size  # a larger draft head's extra ids are never proposed

    def propose(self, sequences: Sequence[ProposalContext], max_tokens: Sequence[int]) -> list[list[int]]:
        proposals: dict[str, list[int]] = {}
        rows: list[DraftRow] = []
        limits: list[int] = []
        for sequence, limit in zip(sequences, max_tokens):
            row = self._catch_up_row(sequence, min(self.num_tokens, limit))
            if row is not None:
                rows.append(row)
                limits.append(min(self.num_tokens, limit))
                proposals[row.request_id] = []
        for depth in range(max(limits, default=0)):
            for row, token in zip(rows, self._greedy_tokens(rows)):
                proposals[row.request_id].append(token)
                row.num_computed_tokens += row.num_new_tokens
                row.num_new_tokens = 1
                row.all_token_ids.append(token)
            kept = [i for i, limit in enumerate(limits) if limit > depth + 1]
            rows, limits = [rows[i] for i in kept], [limits[i] for i in kept]
        for request_id, tokens in proposals.items():  # each fed to the draft but the last: its KV is written
            self.blocks.state(request_id).proposed = tokens[:-1]
        return [proposals.get(s.request_id, []) for s in sequences]

    def _catch_up_row(self, sequence: ProposalContext, k: int) -> DraftRow | None:
        """The sequence's first forward of the round (from the first token the draft's KV lacks to its last),
        its blocks fitted to what the round writes; None when it proposes nothing."""
        token_ids = sequence.all_token_ids
        if k <= 0 or not self.blocks.fit(sequence.request_id, len(token_ids) + k - 1):
            return None
        state = self.blocks.state(sequence.request_id)
        num_valid = state.num_valid(token_ids)
        state.num_known = len(token_ids)
        state.proposed = []
        return DraftRow(sequence.request_id, list(token_ids), num_valid, len(token_ids) - num_valid)

    def _greedy_tokens(self, rows: list[DraftRow]) -> list[int]:
        logits = self.runner.execute(rows).sampling
        tokens: list[int] = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
        return tokens

    def release(self, request_ids: Iterable[str]) -> None:
        self.blocks.release(request_ids)
