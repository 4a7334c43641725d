"""Continuous batching under one token budget per step (no prefill/decode phases).

Every request has `num_computed_tokens` catching up with `num_tokens`. Each step serves the running
requests first (decodes, then unfinished prompt chunks), then admits waiting ones in arrival order while the
token budget, `max_num_seqs` and the KV cache allow. When a running request cannot get a block, the newest
running request is preempted: its blocks are freed and it is recomputed later (from the prefix cache where
its blocks survive).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagedserve.engine.scheduling.kv_cache_manager import KVCacheManager
from pagedserve.engine.scheduling.parallel_sampling import PendingForks
from pagedserve.engine.scheduling.request import Request, RequestStatus
from pagedserve.engine.scheduling.token_budget import fit
from pagedserve.engine.validation import QueueFullError


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # the proposed tokens included
    # Proposed next tokens computed after the last known one (speculative decoding): this step verifies them.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token, whose logits give the next one
        (unless the request only scores its prompt: max_tokens 0)."""
        request = self.request
        known = self.num_new_tokens - len(self.draft_token_ids)
        return request.num_computed_tokens + known == request.num_tokens and request.max_tokens > 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_queue_len: int,
    ) -> None:
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # n > 1: the first sample computes the prompt; its siblings wait here and fork from it at its first token.
        self.forks = PendingForks()
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def queue_capacity(self) -> int:
        """How many may wait: max_queue_len beyond the running batch's free seats.

        Waiting requests that free seats will take at the next step are not a backlog: a burst at an idle
        engine is accepted up to max_num_seqs + max_queue_len, not refused while seats stand empty.
        """
        return self.max_queue_len + max(0, self.max_num_seqs - len(self.running))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[Request]) -> None:
        """Queues requests together (the n samples of one prompt are admitted or refused as one)."""
        capacity = self.queue_capacity()
        if len(self.waiting) + len(requests) > capacity:
            raise QueueFullError(f"the waiting queue is full ({len(self.waiting)} of {capacity} requests wait)")
        for request in requests:
            self._check_fits(request)
        for request in requests:
            self.requests[request.request_id] = request
        leader, siblings = requests[0], requests[1:]
        self.waiting.append(leader)
        self.forks.add(leader, siblings)

    def _check_fits(self, request: Request) -> None:
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens, but this model's context is "
                f"{self.max_model_len} tokens including at least one generated token"
            )

    def schedule(self, proposals: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """`proposals`: guessed next tokens of decoding requests, verified this step where the token budget
        and the KV cache have room for them (a guess never preempts anything: it is dropped instead).

        Decoding requests go first, then the prompt chunks of running requests, then waiting requests: a long
        prompt, however early it came, never takes the step's whole budget from the streams already decoding.
        While a waiting request could take a seat, a running prompt's chunk leaves it half of what is left, so
        a newcomer's first token does not wait for a long prompt to be computed whole either."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        costs: dict[str, int] = {}  # what each scheduled request took of the budget, refunded if it is preempted
        for request in self._decoding_first():
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted this step, for an older request
            if self.kv.outgrew_short_rope(request):  # LongRoPE: recomputed with the long factors
                self.running.remove(request)
                self._requeue(request)
                continue
            drafts = self._fit_drafts(request, (proposals or {}).get(request.request_id, []), budget)
            if drafts:
                num_new = cost = 1 + len(drafts)
            else:
                num_new, cost = fit(request, request.num_computed_tokens, self._chunk_budget(request, budget))
                num_preempted = len(out.preempted)
                if not self._allocate_or_preempt(request, num_new, out.preempted):
                    break  # the request preempted itself: every newer one is gone too
                if len(out.preempted) > num_preempted:
                    budget += _unschedule_preempted(out, costs)
            out.scheduled.append(ScheduledRequest(request, num_new, drafts))
            costs[request.request_id] = cost
            budget -= cost
        if not out.preempted:
            self._admit_waiting(out, budget)
        now = time.monotonic()
        for item in out.scheduled:
            if item.request.times.first_scheduled is None:
                item.request.times.first_scheduled = now
        return out

    def _decoding_first(self) -> list[Request]:
        """The running requests in turn: those decoding (one known token not yet computed), then those still
        computing their prompts (or a jump-forward's tokens), each group in arrival order."""
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens <= 1]
        computing = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        return decoding + computing

    def _chunk_budget(self, request: Request, budget: int) -> int:
        """What a running request's next chunk may take: all that is left, or half of it (at least one token)
        while the first waiting request could take a seat and this chunk is not a decode."""
        if request.num_tokens - request.num_computed_tokens <= 1 or not self.waiting:
            return budget
        if len(self.running) + self.forks.seats_needed(self.waiting[0]) > self.max_num_seqs:
            return budget
        return max(1, budget // 2)

    def _fit_drafts(self, request: Request, drafts: list[int], budget: int) -> list[int]:
        """The proposed tokens a decoding request verifies this step: all of them, with their KV slots
        allocated, or none (no budget or no free block for them)."""
        if not drafts or request.num_computed_tokens != request.num_tokens - 1 or 1 + len(drafts) > budget:
            return []
        if self.kv.crosses_short_rope(request, request.num_tokens + len(drafts)):
            return []  # verified past LongRoPE's threshold, they would be rotated short
        return drafts if self.kv.allocate_slots(request, 1 + len(drafts)) else []

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[Request]) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self._requeue(request)
        request.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, request: Request) -> None:
        """Frees the request's blocks and puts it first in line, to be computed again."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if len(self.running) + self.forks.seats_needed(request) > self.max_num_seqs:
                break
            hits, num_cached = self.kv.get_computed_blocks(request)
            num_new, cost = fit(request, num_cached, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= cost

    def update(
        self, out: SchedulerOutput, sampled: dict[str, int], verified: dict[str, list[int]] | None = None
    ) -> list[Request]:
        """Advances computed tokens, appends sampled tokens, finishes requests that hit a token-level stop.

        `sampled` also holds the first tokens of siblings that fork this step (see `PendingForks.pending`).
        `verified`: the tokens of requests that verified proposals this step (the accepted ones, then the
        target's own), appended one by one up to the first stop. Returns the requests that received a token.
        """
        progressed = []
        for item in out.scheduled:
            request = item.request
            if item.draft_token_ids:
                tokens = (verified or {}).get(request.request_id)
                if tokens is not None and not request.is_finished:
                    self._take_verified(request, tokens)
                    progressed.append(request)
                continue
            request.num_computed_tokens += item.num_new_tokens
            token = sampled.get(request.request_id)
            if token is None or request.is_finished:
                continue
            forking = bool(self.forks.pending(request))
            request.append_output_token(token)
            progressed.append(request)
            if forking:  # before the leader may finish and free the blocks its siblings share
                progressed.extend(self.fork(request, sampled))
            status = self._token_stop(request, token)
            if status is not None:
                self.finish(request.request_id, status)
        return progressed

    def fork(self, leader: Request, token_ids: dict[str, int]) -> list[Request]:
        """Starts the leader's siblings on its computed prompt blocks, each with its own first token."""
        siblings = self.forks.pop(leader)
        now = time.monotonic()
        for child in siblings:
            self.kv.fork(leader, child)
            child.num_computed_tokens = child.num_prompt_tokens
            child.prompt_logprobs = leader.prompt_logprobs  # they came with the prompt's computation
            child.status = RequestStatus.RUNNING
            child.times.first_scheduled = leader.times.first_scheduled or now
            self.running.append(child)
            self.append_token(child, token_ids[child.request_id])
        return siblings

    def _take_verified(self, request: Request, tokens: list[int]) -> None:
        """The last known token and the accepted proposals are computed; the rejected ones' KV is rolled back:
        their positions are written again later, and the blocks only they needed go back to the pool."""
        request.num_computed_tokens += len(tokens)  # the last known token + len(tokens) - 1 accepted proposals
        for token in tokens:
            self.append_token(request, token)
            if request.is_finished:
                return
        self.kv.trim(request, request.num_tokens)

    def append_token(self, request: Request, token: int) -> None:
        """Appends a token to a running request and ends it at a token-level stop (length, EOS, stop ids)."""
        request.append_output_token(token)
        status = self._token_stop(request, token)
        if status is not None:
            self.finish(request.request_id, status)

    def _token_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if request.num_output_tokens <= params.min_tokens:
            return None
        if token in request.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        return None

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request wherever it is (waiting, running, finished already) and frees its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        successor = self.forks.forget(request)
        if successor is not None:  # a leader ended before its siblings forked: one of them takes the prompt
            self.waiting.appendleft(successor)
        request.status = status
        request.times.finished = time.monotonic()
        self.kv.free(request)
        return request


def _unschedule_preempted(out: SchedulerOutput, costs: dict[str, int]) -> int:
    """Drops the requests preempted after they were scheduled this step; returns the budget they had taken."""
    dropped = [item for item in out.scheduled if item.request.status != RequestStatus.RUNNING]
    out.scheduled = [item for item in out.scheduled if item.request.status == RequestStatus.RUNNING]
    return sum(costs[item.request.request_id] for item in dropped)
