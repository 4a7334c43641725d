"""The engine's side of structured output: matchers for sequences, masks for a step, tokens the grammar forces.

One step with constrained sequences runs as: `start` (masks filled on a worker thread) -> the forward ->
`mask` (the logits of constrained rows restricted) -> sampling -> `consume` (each matcher takes its token)
-> the scheduler's update -> `settle` (sequences whose constraint is complete end; greedy ones append the
tokens their grammar forces without a forward pass each: jump-forward).
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from pagedserve.engine.scheduling.request import Request, RequestStatus
from pagedserve.engine.scheduling.scheduler import Scheduler
from pagedserve.engine.structured.grammar import GrammarCompiler, GrammarRows, StepMasks, only_allowed_token

logger = logging.getLogger(__name__)


@dataclass
class ConstraintStats:
    num_requests: int = 0  # requests that came with a constraint
    compile_seconds: float = 0.0
    mask_seconds: float = 0.0  # filling masks (worker thread, overlapping the forward)
    mask_wait_seconds: float = 0.0  # steps waiting for masks after their forward
    num_jumped_tokens: int = 0  # tokens appended by jump-forward


class Constraints:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        jump_forward: bool = True,
    ) -> None:
        self.jump_forward = jump_forward
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self._masks = StepMasks(vocab_size)
        self._vocab_size = vocab_size
        self._num_requests = 0
        self._num_jumped = 0

    def attach(self, sequences: list[Request]) -> None:
        """Gives each sequence of a constrained request its own matcher (ValueError: a bad constraint)."""
        constraint = sequences[0].params.structured_output
        if constraint is None:
            return
        for sequence in sequences:
            sequence.grammar = self.compiler.matcher(constraint)
        self._num_requests += 1

    def start(self, sampling: list[Request]) -> concurrent.futures.Future[GrammarRows] | None:
        return self._masks.start([r.grammar for r in sampling])

    def mask(self, logits: torch.Tensor, pending: concurrent.futures.Future[GrammarRows] | None) -> torch.Tensor:
        """The logits with every token a constraint refuses at -inf (a copy; the same tensor if none)."""
        rows = self._masks.wait(pending)
        return logits if rows is None else rows.apply(logits)

    def discard(self, pending: concurrent.futures.Future[GrammarRows] | None) -> None:
        """Waits out masks nobody will use: no matcher may move while the worker reads it."""
        if pending is not None:
            concurrent.futures.wait([pending])

    @staticmethod
    def consume(sampling: list[Request], sampled: dict[str, int]) -> dict[str, str]:
        """Advances each matcher by its sequence's token; the callers' ids of requests whose token the
        constraint refused (a bug if it happens: the mask admitted it), with why."""
        refused: dict[str, str] = {}
        for request in sampling:
            token = sampled.get(request.request_id)
            if request.grammar is None or token is None:
                continue
            if not request.grammar.consume_token(token):
                logger.error("request %s: constraint refused token %d", request.parent_id, token)
                refused[request.parent_id] = f"the output constraint refused token {token}"
        return refused

    def settle(self, progressed: list[Request], scheduler: Scheduler) -> dict[str, list[int]]:
        """Ends sequences whose constraint is complete and appends the tokens greedy ones are forced to take;
        returns those tokens by sequence id."""
        jumped: dict[str, list[int]] = {}
        for request in progressed:
            if request.grammar is None or request.is_finished:
                continue
            if self.jump_forward and request.params.jumps_forward:
                forced = self._jump_forward(request, scheduler)
                if forced:
                    jumped[request.request_id] = forced
            if not request.is_finished and request.grammar.is_stopped():
                scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
        return jumped

    def _jump_forward(self, request: Request, scheduler: Scheduler) -> list[int]:
        """Appends tokens while the grammar admits exactly one: greedy decoding would pick it whatever the
        logits, so the output equals the slow path's, token for token, without their forward passes."""
        assert request.grammar is not None
        forced: list[int] = []
        while not request.is_finished and not request.grammar.is_stopped():
            token = only_allowed_token(request.grammar, self._vocab_size)
            if token is None or not request.grammar.consume_token(token):
                break
            scheduler.append_token(request, token)
            forced.append(token)
        self._num_jumped += len(forced)
        return forced

    def stats(self) -> ConstraintStats:
        return ConstraintStats(
            num_requests=self._num_requests,
            compile_seconds=self.compiler.compile_seconds,
            mask_seconds=self._masks.mask_seconds,
            mask_wait_seconds=self._masks.wait_seconds,
            num_jumped_tokens=self._num_jumped,
        )

    def close(self) -> None:
        self._masks.close()
