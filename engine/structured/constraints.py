"""The engine's side of structured output: matchers for sequences, masks for a step, tokens the grammar forces.

A request whose grammar is not compiled yet waits here, outside the scheduler, while it compiles on a thread
(seconds, for a big grammar): the batch steps on without it, and it joins once compiled (`take_compiled`).

One step with constrained sequences runs as: `start` (masks filled on a worker thread) -> the forward ->
`mask` (the logits of constrained rows restricted) -> sampling -> `consume` (each matcher takes its token)
-> the scheduler's update -> `settle` (sequences whose constraint is complete end; greedy ones append the
tokens their grammar forces without a forward pass each: jump-forward).
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass

import llguidance
import torch
from transformers import PreTrainedTokenizerBase

from pagedserve.engine.scheduling.request import Request, RequestStatus
from pagedserve.engine.scheduling.scheduler import Scheduler
from pagedserve.engine.structured.grammar import GrammarCompiler, library_error
from pagedserve.engine.structured.masks import GrammarRows, StepMasks, only_allowed_token

logger = logging.getLogger(__name__)
Compiled = concurrent.futures.Future[llguidance.LLMatcher]


@dataclass
class ConstraintStats:
    num_requests: int = 0  # requests that came with a constraint
    compile_seconds: float = 0.0
    mask_seconds: float = 0.0  # filling masks (worker thread, overlapping the forward)
    mask_wait_seconds: float = 0.0  # steps waiting for masks after their forward
    num_jumped_tokens: int = 0  # tokens appended by jump-forward


def constraint_failure(matcher: llguidance.LLMatcher, token: int | None = None) -> str:
    """Why a sequence's constraint stopped it. Its mask admitted the token, so the grammar engine gave up
    there: a limit it checks on consuming only (a row's items), met mid-generation; its error names it."""
    where = "" if token is None else f" at token {token}"
    return f"the output constraint became too complex for the grammar engine{where}: {library_error(matcher)}"


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
        self._prepare()
        self._masks = StepMasks(vocab_size)
        self._vocab_size = vocab_size
        self._num_requests = 0
        self._num_jumped = 0
        self._compiling: dict[str, tuple[Compiled, list[Request]]] = {}  # caller's id -> its sequences

    def _prepare(self) -> None:
        """Builds llguidance's tokenizer now, as the engine loads: it holds the GIL for about a second, which
        at a first constrained request would stall the batch (once per process: it is shared)."""
        try:
            self.compiler.prepare()
        except Exception:  # not a fast tokenizer: constrained requests will fail with the reason
            logger.warning("llguidance cannot read this tokenizer; constrained requests will fail", exc_info=True)

    # ---- requests in, while their grammar compiles -------------------------------------------------

    def attach(self, sequences: list[Request]) -> bool:
        """Gives each sequence of a constrained request its own matcher; True when they may be scheduled now.
        False: the grammar compiles off the step loop and `take_compiled` hands them back. ValueError: a
        constraint known to be bad."""
        constraint = sequences[0].params.structured_output
        if constraint is None:
            return True
        compiled = self.compiler.compile(constraint)
        ready = compiled.done()  # read once: it may finish any moment
        if ready:
            _give_matchers(sequences, compiled.result())
        else:
            self._compiling[sequences[0].parent_id] = (compiled, sequences)
        self._num_requests += 1
        return ready

    def take_compiled(self) -> tuple[list[list[Request]], list[tuple[list[Request], str]]]:
        """The requests whose grammar has compiled since (their sequences, each with its matcher), and those
        whose grammar failed to compile, with why."""
        ready: list[list[Request]] = []
        failed: list[tuple[list[Request], str]] = []
        for parent_id, (compiled, sequences) in list(self._compiling.items()):
            if not compiled.done():
                continue
            del self._compiling[parent_id]
            error = compiled.exception()
            if error is None:
                _give_matchers(sequences, compiled.result())
                ready.append(sequences)
            else:
                why = str(error) if isinstance(error, ValueError) else f"compiling the constraint failed: {error!r}"
                failed.append((sequences, why))
        return ready, failed

    def wait_compiled(self, timeout: float) -> None:
        """Waits up to `timeout` for a grammar to finish compiling (at once when none compiles)."""
        pending = [compiled for compiled, _ in self._compiling.values()]
        if pending:
            concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def cancel(self, parent_id: str) -> list[Request]:
        """The sequences of a request still compiling its grammar, forgotten (its compile runs on: the matcher
        is cached for the next request with that constraint)."""
        entry = self._compiling.pop(parent_id, None)
        return [] if entry is None else entry[1]

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def compiling_ids(self) -> set[str]:
        return set(self._compiling)

    # ---- one step ----------------------------------------------------------------------------------

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
        """Advances each matcher by its sequence's token; the callers' ids of requests whose constraint failed
        (a limit met while its mask was built, or its token refused), with why."""
        refused: dict[str, str] = {}
        for request in sampling:
            token = sampled.get(request.request_id)
            if request.grammar is None or token is None:
                continue
            if request.grammar.is_error():  # its mask met a limit: it admitted only EOS, which says nothing
                refused[request.parent_id] = constraint_failure(request.grammar)
            elif not request.grammar.consume_token(token):
                logger.error("request %s: constraint refused token %d", request.parent_id, token)
                refused[request.parent_id] = constraint_failure(request.grammar, token)
        return refused

    def settle(self, progressed: list[Request], scheduler: Scheduler) -> tuple[dict[str, list[int]], dict[str, str]]:
        """Ends sequences whose constraint is complete and appends the tokens greedy ones are forced to take;
        returns those tokens by sequence id, and the callers' ids of requests whose constraint failed meanwhile
        (a limit met on a forced token), with why: a matcher in error counts as stopped, never as complete."""
        jumped: dict[str, list[int]] = {}
        failed: dict[str, str] = {}
        for request in progressed:
            if request.grammar is None or request.is_finished:
                continue
            if self.jump_forward and request.params.jumps_forward:
                forced = self._jump_forward(request, scheduler)
                if forced:
                    jumped[request.request_id] = forced
            if request.grammar.is_error():
                failed[request.parent_id] = constraint_failure(request.grammar)
            elif not request.is_finished and request.grammar.is_stopped():
                scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
        return jumped, failed

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


def _give_matchers(sequences: list[Request], pristine: llguidance.LLMatcher) -> None:
    for sequence in sequences:
        sequence.grammar = pristine.deep_copy()
