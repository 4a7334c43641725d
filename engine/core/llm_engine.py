"""LLMEngine: requests in, per-step token deltas out. Synchronous; the engine core (engine/core/loop.py) drives it."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass

import torch

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.messages import EngineSnapshot
from pagedserve.engine.core.sampler import Sampler
from pagedserve.engine.core.speculator import (
    SpeculationStats,
    Speculator,
    make_proposer,
    split_rows,
    step_costs,
    token_budget,
)
from pagedserve.engine.outputs import PromptLogprobs, RequestMetrics, SequenceDelta, TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduling.hybrid_kv_cache_manager import kv_cache_manager
from pagedserve.engine.scheduling.parallel_sampling import RequestGroups, expand_logits, make_samples, sibling_rows
from pagedserve.engine.scheduling.request import Request, RequestStatus
from pagedserve.engine.scheduling.scheduler import Scheduler, SchedulerOutput
from pagedserve.engine.structured.constraints import Constraints
from pagedserve.engine.text.detokenizer import IncrementalDetokenizer
from pagedserve.engine.validation import RequestLimits
from pagedserve.engine.worker import LoadedModel, ModelExecutor, ModelRunner, RankLostError

logger = logging.getLogger(__name__)
Sampled = tuple[int, TokenLogprob | None]  # a sequence's next token, and its logprobs when asked for
COMPILE_POLL_SECONDS = 0.05  # with nothing to step but grammars compiling: how long a step waits for them


@dataclass
class EngineStats:
    """Cumulative counters for metrics and benchmarks."""

    num_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    step_seconds: float = 0.0
    peak_kv_tokens: int = 0  # tokens held in KV at the fullest step
    peak_kv_slots: int = 0  # block slots allocated at that step
    peak_running: int = 0
    forward_seconds: float = 0.0  # in the model's forward; filled by collect_stats from the runner's clock
    communication_seconds: float = 0.0  # rank 0's time in tensor-parallel collectives (inside forward_seconds)
    tensor_parallel_size: int = 1
    speculation: SpeculationStats = dataclasses.field(default_factory=SpeculationStats)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        """With tensor_parallel_size N > 1 the executor is rank 0 and drives the other ranks; close() ends them."""
        self.config = config or EngineConfig()
        self.executor = ModelExecutor(self.config, loaded)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        executor, plan = self.executor, self.executor.kv_plan
        self.loaded = executor.loaded
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = plan.max_model_len
        self.limits = RequestLimits(
            max_model_len=plan.max_model_len,
            vocab_size=self.loaded.spec.vocab_size,
            max_n=self.config.max_n,
            max_num_seqs=self.config.max_num_seqs,
            max_logprobs=self.config.max_logprobs,
            max_queue_len=self.config.max_queue_len,
        )
        identity = f"{self.loaded.model_dir}:{self.loaded.dtype}".encode()
        self.kv = kv_cache_manager(
            plan.num_blocks,
            plan.block_size,
            plan.group_windows,
            self.config.enable_prefix_caching,
            hashlib.sha256(identity).digest(),
            self.loaded.spec.long_rope_threshold,
        )
        executor.bind_kv_cache(self.kv)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_queue_len=self.config.max_queue_len,
        )
        self.sampler = Sampler()
        self.constraints = Constraints(
            self.tokenizer, self.loaded.spec.vocab_size, self.loaded.eos_token_ids, self.config.jump_forward
        )
        # After what close() ends: a draft model that cannot serve (another vocabulary) fails the start cleanly.
        proposer = make_proposer(self.config, self.loaded, plan.num_blocks)
        budget = token_budget(self.config, self.loaded)
        self.speculator = Speculator(self.config, self.max_model_len, proposer, budget, step_costs(self.loaded))
        self.stats = EngineStats()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._children = RequestGroups()  # caller's id -> ids of its n sequences
        logger.info(
            "KV cache: %.0f MiB (--kv-cache-memory), %d blocks of %d tokens = %d tokens%s; max_model_len %d",
            plan.num_bytes / 2**20,
            plan.num_blocks,
            plan.block_size,
            plan.num_tokens,
            "" if len(plan.group_windows) == 1 else f" shared by {len(plan.group_windows)} KV cache groups",
            plan.max_model_len,
        )

    @property
    def runner(self) -> ModelRunner:
        return self.executor.runner

    # ---- requests in -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queues a request (its n samples together). It must have passed check_request(self.limits, ...)
        (engine/validation.py): the engine's public API (AsyncEngine, LLM) checks every request once."""
        if request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in use")
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        children = make_samples(
            request_id,
            token_ids,
            params,
            max_tokens=max_tokens,
            eos_token_ids=self.loaded.eos_token_ids,
            arrival_time=arrival_time,
        )
        if self.constraints.attach(children):  # else its grammar compiles off the step loop: step() admits it
            self.scheduler.add_requests(children)
        self._children.add(request_id, children)
        if params.detokenize:
            backend_tokenizer = self.tokenizer.backend_tokenizer
            for child in children:
                self._detokenizers[child.request_id] = IncrementalDetokenizer(backend_tokenizer, token_ids, params)

    def abort_request(self, request_id: str) -> list[SequenceDelta]:
        """Ends every sequence of a request; returns their final deltas (finish_reason "abort")."""
        deltas = self._finish_group(request_id, RequestStatus.FINISHED_ABORTED)
        self.speculator.follow(self.scheduler.running)  # a proposer's state for them goes now, not at a next step
        return deltas

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.constraints.num_compiling > 0

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._children)

    def request_ids(self) -> list[str]:
        """The callers' ids of every unfinished request."""
        return list(self._children)

    def waiting_request_ids(self) -> set[str]:
        """Callers' ids of requests never scheduled yet (preempted ones were admitted once: not these)."""
        waiting = {r.parent_id for r in self.scheduler.waiting if r.status is RequestStatus.WAITING}
        return waiting | self.constraints.compiling_ids()

    @property
    def num_tokens_processed(self) -> int:
        return self.runner.num_tokens_processed

    def snapshot(self) -> EngineSnapshot:
        constraints = self.constraints.stats()
        constraints_compiling = self.constraints.num_compiling  # waiting too, outside the scheduler
        speculation = self.speculator.totals
        return EngineSnapshot(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + constraints_compiling,
            num_unfinished=len(self._children),
            queue_capacity=self.scheduler.queue_capacity(),
            kv_cache_usage=self.kv.usage(),
            num_free_blocks=self.kv.pool.num_free,
            num_kv_blocks=self.kv.num_blocks,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            constrained_requests=constraints.num_requests,
            grammar_compile_seconds=constraints.compile_seconds,
            grammar_mask_seconds=constraints.mask_seconds,
            grammar_mask_wait_seconds=constraints.mask_wait_seconds,
            jump_forward_tokens=constraints.num_jumped_tokens,
            tensor_parallel_size=self.config.tensor_parallel_size,
            communication_seconds=self.executor.communication_seconds,
            spec_decode_num_drafts=speculation.num_drafts,
            spec_decode_num_draft_tokens=speculation.num_draft_tokens,
            spec_decode_num_accepted_tokens=speculation.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(speculation.accepted_per_position),
        )

    def collect_stats(self, reset: bool = False) -> EngineStats:
        stats = dataclasses.replace(
            self.stats,
            speculation=dataclasses.replace(self.speculator.stats),
            forward_seconds=self.runner.forward_seconds,
            communication_seconds=self.executor.communication_seconds,
            tensor_parallel_size=self.config.tensor_parallel_size,
        )
        if reset:
            self.stats = EngineStats()
            self.speculator.stats = SpeculationStats()
            self.executor.reset_clocks()
        return stats

    def check_health(self) -> None:
        """Raises RankLostError once a tensor-parallel rank has died or hung (nothing to check otherwise)."""
        self.executor.check_health()

    @property
    def health_check_seconds(self) -> float | None:
        """How often an idle engine should check_health(); None: never needed (nothing runs beside it)."""
        return 1.0 if self.executor.has_ranks else None

    def close(self) -> None:
        """Ends the tensor-parallel ranks and the grammar worker (nothing else outlives this object)."""
        self.constraints.close()
        self.executor.close()

    # ---- one step ----------------------------------------------------------------------------------

    def step(self) -> list[SequenceDelta]:
        """One forward pass and its tokens. A request whose sampling or detokenization fails is failed alone
        (its blocks freed); the others carry on with the tokens they would have had without it.

        Requests whose grammar has compiled since the last step join first (one that failed to compile ends
        with its error); with nothing else to run, the step waits a moment for a compile rather than spin."""
        if not self.scheduler.has_unfinished():
            self.constraints.wait_compiled(COMPILE_POLL_SECONDS)
        deltas = self._admit_compiled()
        return deltas + self._step() if self.scheduler.has_unfinished() else deltas

    def _admit_compiled(self) -> list[SequenceDelta]:
        ready, failed = self.constraints.take_compiled()
        for sequences in ready:
            try:
                self.scheduler.add_requests(sequences)
            except Exception as exc:  # the queue filled while it compiled
                failed.append((sequences, str(exc)))
        return [d for sequences, why in failed for d in self._end_unscheduled(sequences, why)]

    def _end_unscheduled(
        self, sequences: list[Request], error: str | None, status: RequestStatus = RequestStatus.FINISHED_ERROR
    ) -> list[SequenceDelta]:
        """Final deltas of sequences the scheduler never held (their grammar was compiling)."""
        for sequence in sequences:
            sequence.status = status
            sequence.times.finished = time.monotonic()
        return [self._final_delta(sequence, error) for sequence in sequences]

    def _step(self) -> list[SequenceDelta]:
        start = time.perf_counter()
        out = self.scheduler.schedule(self.speculator.propose(self.scheduler.running))
        if out.is_empty:
            return self._errors_for_stuck_requests()
        plain = [s.request for s in out.scheduled if s.samples and not s.draft_token_ids]
        sampling, rows = sibling_rows(plain, self.scheduler.forks)
        masks = self.constraints.start(sampling)  # filled while the forward runs
        try:
            logits = self.executor.execute(out.scheduled, self.kv.take_pending_copies())
        except RankLostError:  # the ranks may be out of step: nothing more can run
            raise
        except Exception as exc:  # a failed forward fails its requests, not the engine
            self.constraints.discard(masks)
            logger.exception("engine step failed; failing its %d requests", len(out.scheduled))
            ids = {s.request.parent_id for s in out.scheduled}
            return [d for rid in ids for d in self._finish_group(rid, RequestStatus.FINISHED_ERROR, str(exc))]
        for item in out.scheduled if logits.prompt_logprobs else ():
            item.request.prompt_logprobs += logits.prompt_logprobs.get(item.request.request_id, [])
        plain_logits, verifying, verifying_logits = split_rows(logits.sampling, out.scheduled)
        sampled, failed = self._sample(sampling, self.constraints.mask(expand_logits(plain_logits, rows), masks))
        verified, refused = self.speculator.verify_all(verifying, verifying_logits)
        tokens = {rid: token for rid, (token, _) in sampled.items()}
        failed |= refused | self.constraints.consume(sampling, tokens)
        deltas = [d for rid, why in failed.items() for d in self._finish_group(rid, RequestStatus.FINISHED_ERROR, why)]
        before = {s.request.request_id: s.request.num_output_tokens for s in out.scheduled}
        progressed = self.scheduler.update(out, tokens, verified)
        _, broken = self.constraints.settle(progressed, self.scheduler)
        deltas += [d for rid, why in broken.items() for d in self._finish_group(rid, RequestStatus.FINISHED_ERROR, why)]
        progressed = [r for r in progressed if r.parent_id not in broken]
        # One token a sequence, or several: those a constraint forced after it, or accepted proposals.
        num_new = {r.request_id: r.num_output_tokens - before.get(r.request_id, 0) for r in progressed}
        for request in progressed:
            logprob = sampled.get(request.request_id, (0, None))[1]
            deltas += self._delta_or_failure(request, logprob, num_new[request.request_id])
        deltas += self._finish_prompt_only(out)
        self.speculator.follow(self.scheduler.running)
        self.speculator.note_step(out, start, time.perf_counter())
        self._record_step(progressed, num_new, start)
        return deltas

    def _sample(self, sampling: list[Request], logits: torch.Tensor) -> tuple[dict[str, Sampled], dict[str, str]]:
        """The sampled token of each sequence (a row of `logits` each), and the callers' ids of requests whose
        sampling failed (why).

        The batch is sampled at once; if that raises, row by row from the same logits, with the seeded
        generators rewound, so the rows that do not fail draw exactly what they would have in the batch.
        """
        if not sampling:
            return {}, {}
        rewind = [(r.generator, r.generator.get_state()) for r in sampling if r.generator is not None]
        try:
            result = self.sampler(logits, sampling)
            return {r.request_id: (t, lp) for r, t, lp in zip(sampling, result.token_ids, result.logprobs)}, {}
        except Exception:
            logger.exception("sampling a batch of %d sequences failed; sampling them one by one", len(sampling))
        for generator, state in rewind:
            generator.set_state(state)
        sampled: dict[str, Sampled] = {}
        failed: dict[str, str] = {}
        for row, request in enumerate(sampling):
            try:
                alone = self.sampler(logits[row : row + 1], [request])
            except Exception as exc:
                logger.error("request %s: sampling failed (%r); failing it", request.parent_id, exc)
                failed[request.parent_id] = f"sampling failed: {exc}"
                continue
            sampled[request.request_id] = (alone.token_ids[0], alone.logprobs[0])
        return sampled, failed

    def _finish_prompt_only(self, out: SchedulerOutput) -> list[SequenceDelta]:
        """Requests with max_tokens 0 end once their prompt is computed (scored), with no token."""
        deltas = []
        for item in out.scheduled:
            request = item.request
            if request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
                self.scheduler.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
                deltas.append(self._final_delta(request, None))
        return deltas

    def _delta_or_failure(self, request: Request, logprob: TokenLogprob | None, num_new: int) -> list[SequenceDelta]:
        """The sequence's delta for this step (its `num_new` last tokens); if building it fails
        (detokenization), its request's end."""
        try:
            return [self._delta(request, logprob, num_new)]
        except Exception as exc:
            logger.exception("request %s: detokenization failed; failing it", request.parent_id)
            why = f"detokenization failed: {exc}"
            self._detokenizers.pop(request.request_id, None)
            ended = []
            if request.is_finished:  # the scheduler ended it this step: _finish_group would no longer find it
                request.status = RequestStatus.FINISHED_ERROR
                ended.append(self._final_delta(request, why))
            return ended + self._finish_group(request.parent_id, RequestStatus.FINISHED_ERROR, why)

    def _delta(self, request: Request, logprob: TokenLogprob | None, num_new: int) -> SequenceDelta:
        if request.times.first_token is None:
            request.times.first_token = time.monotonic()
        new_tokens = request.output_token_ids[-num_new:]
        text, stop_string = "", None
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is not None:
            text, stop_string, kept = _detokenize(detokenizer, new_tokens, bool(request.params.stop))
            if kept < len(new_tokens):  # a stop string ended the run before its last tokens: they never came
                request.truncate_output(len(new_tokens) - kept)
                new_tokens = new_tokens[:kept]
                if request.is_finished:  # at a token-level stop after the stop string: the string came first
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.stop_reason = stop_string
        if stop_string is not None and not request.is_finished:
            request.stop_reason = stop_string
            self.scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
        elif request.is_finished and detokenizer is not None:
            text += detokenizer.flush()
        delta = SequenceDelta(
            request_id=request.parent_id,
            index=request.index,
            new_token_ids=new_tokens,
            new_text=text,
            new_logprobs=None if logprob is None else [logprob],
            prompt_logprobs=_prompt_logprobs(request) if request.num_output_tokens == len(new_tokens) else None,
        )
        if request.is_finished:
            self._complete(request, delta)
        return delta

    def _complete(self, request: Request, delta: SequenceDelta, error: str | None = None) -> None:
        """Fills the finishing fields of `delta` and forgets the sequence."""
        times = request.times
        delta.finish_reason = request.status.value
        delta.stop_reason = request.stop_reason
        delta.num_prompt_tokens = request.num_prompt_tokens
        delta.num_cached_tokens = request.num_cached_tokens
        delta.num_output_tokens = request.num_output_tokens
        delta.error = error
        delta.metrics = RequestMetrics(
            arrival_time=times.arrival,
            queue_time=None if times.first_scheduled is None else times.first_scheduled - times.arrival,
            time_to_first_token=None if times.first_token is None else times.first_token - times.arrival,
            e2e_latency=(times.finished or time.monotonic()) - times.arrival,
            num_preemptions=request.num_preemptions,
        )
        self._detokenizers.pop(request.request_id, None)
        self._children.discard(request)

    def _finish_group(self, request_id: str, status: RequestStatus, error: str | None = None) -> list[SequenceDelta]:
        deltas = self._end_unscheduled(self.constraints.cancel(request_id), error, status)
        for child_id in self._children.members(request_id):
            request = self.scheduler.finish(child_id, status)
            if request is not None:
                deltas.append(self._final_delta(request, error))
        return deltas

    def _final_delta(self, request: Request, error: str | None) -> SequenceDelta:
        """The last delta of a sequence ended outside the sampling path (abort, error): held-back text only."""
        detokenizer = self._detokenizers.get(request.request_id)
        delta = SequenceDelta(request.parent_id, request.index, [], detokenizer.flush() if detokenizer else "")
        if request.num_output_tokens == 0 and error is None:
            delta.prompt_logprobs = _prompt_logprobs(request)
        self._complete(request, delta, error)
        return delta

    def _errors_for_stuck_requests(self) -> list[SequenceDelta]:
        """Nothing could be scheduled although requests wait: fail the head of the queue, not the engine."""
        if not self.scheduler.waiting or self.scheduler.running:
            return []
        head = self.scheduler.waiting[0]
        logger.error("request %s cannot fit the KV cache; failing it", head.request_id)
        return self._finish_group(head.parent_id, RequestStatus.FINISHED_ERROR, "the request does not fit the KV cache")

    def _record_step(self, progressed: list[Request], num_new: dict[str, int], start: float) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.step_seconds += time.perf_counter() - start
        stats.generation_tokens += sum(num_new.values())
        # A prompt counts once: at its first tokens (not again after a preemption), not per parallel sample.
        stats.prompt_tokens += sum(
            r.num_prompt_tokens for r in progressed if r.num_output_tokens == num_new[r.request_id] and r.index == 0
        )
        stats.peak_running = max(stats.peak_running, self.scheduler.num_running)
        slots = (self.kv.num_blocks - self.kv.pool.num_free) * self.kv.block_size
        if slots > stats.peak_kv_slots:
            stats.peak_kv_slots = slots
            stats.peak_kv_tokens = self.kv.num_stored_tokens(self.scheduler.running)

    # ---- convenience -------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()


def _detokenize(detokenizer: IncrementalDetokenizer, tokens: list[int], has_stops: bool) -> tuple[str, str | None, int]:
    """The text of a step's new tokens, the stop string that matched, and how many tokens it kept: with stop
    strings and several tokens (accepted proposals, forced ones) a token at a time, up to the first stop."""
    if not has_stops or len(tokens) == 1:
        text, stop = detokenizer.update(tokens)
        return text, stop, len(tokens)
    pieces = []
    for count, token in enumerate(tokens, 1):
        piece, stop = detokenizer.update([token])
        pieces.append(piece)
        if stop is not None:
            return "".join(pieces), stop, count
    return "".join(pieces), None, len(tokens)


def _prompt_logprobs(request: Request) -> PromptLogprobs | None:
    """The request's prompt logprobs in full (the first token has none), once its prompt is computed."""
    if request.params.prompt_logprobs is None or len(request.prompt_logprobs) < request.num_prompt_tokens - 1:
        return None
    return [None, *request.prompt_logprobs]
