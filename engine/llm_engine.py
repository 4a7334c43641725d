"""LLMEngine: requests in, per-step token deltas out. Synchronous; the async engine drives it in a thread."""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import torch

from pagedserve.engine import openmp_policy
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.cuda_graphs import cuda_graph_capture, graph_batch_sizes
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.kv_cache_manager import KVCacheManager
from pagedserve.engine.model_loader import LoadedModel, kv_cache_budget, load_model, resolve_max_model_len
from pagedserve.engine.model_runner import ModelRunner, allocate_kv_caches, kv_bytes_per_block
from pagedserve.engine.outputs import RequestMetrics, SequenceDelta, TokenLogprob
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.sampler import Sampler
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduler import Scheduler, SchedulerOutput
from pagedserve.engine.tokenizer import Message, apply_chat_template

logger = logging.getLogger(__name__)


class ContextLengthError(ValueError):
    """The prompt does not fit the model's context; carries the numbers for the error message."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens (at least one token must be left to generate)."
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


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


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        self.config = config or EngineConfig()
        self.loaded = loaded or load_model(self.config)
        openmp_policy.warn_if_set_too_late(self.loaded.device.type)
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.tokenizer = self.loaded.tokenizer
        self.vocab_size = self.loaded.spec.vocab_size
        num_blocks = self._num_kv_blocks()
        # A request must always fit the cache alone, or preemption could cycle forever.
        self.max_model_len = min(
            resolve_max_model_len(self.config, self.loaded.spec), num_blocks * self.config.block_size
        )
        identity = f"{self.loaded.model_dir}:{self.loaded.dtype}".encode()
        self.kv = KVCacheManager(
            num_blocks,
            self.config.block_size,
            self.config.enable_prefix_caching,
            hashlib.sha256(identity).digest(),
        )
        caches = allocate_kv_caches(
            self.loaded.spec, num_blocks, self.config.block_size, self.loaded.dtype, self.loaded.device
        )
        self.runner = ModelRunner(self.loaded.model, self.loaded.backend, self.kv, caches, self.loaded.device)
        if self._use_cuda_graphs():
            sizes = graph_batch_sizes(self.config.max_num_seqs)
            self.runner.capture_decode_graphs(sizes, self.max_model_len, cuda_graph_capture())
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_queue_len=self.config.max_queue_len,
        )
        self.sampler = Sampler()
        self.stats = EngineStats()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._children: dict[str, list[str]] = {}  # caller's id -> ids of its n sequences
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens; max_model_len %d",
            num_blocks,
            self.config.block_size,
            num_blocks * self.config.block_size,
            self.max_model_len,
        )

    def _use_cuda_graphs(self) -> bool:
        if self.loaded.device.type != "cuda" or self.config.enforce_eager:
            return False
        if not self.loaded.backend.supports_cuda_graphs:
            logger.info("CUDA graphs off: the %s attention backend cannot be recorded", self.loaded.backend.name)
            return False
        return True

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        peak = None
        if self.loaded.device.type == "cuda":
            peak = self._profile_peak_memory()
        budget = kv_cache_budget(self.config, self.loaded.device, peak)
        per_block = kv_bytes_per_block(self.loaded.spec, self.config.block_size, self.loaded.dtype)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget ({budget} bytes) holds no block of {per_block} bytes")
        return num_blocks

    def _profile_peak_memory(self) -> int:
        """Peak CUDA memory of a forward pass over a full token budget, on a throwaway one-block cache."""
        from pagedserve.engine.profiling import profile_forward_peak  # CUDA only

        return profile_forward_peak(self.loaded, self.config)

    # ---- requests in -------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return token_ids

    def encode_chat(self, messages: list[Message]) -> list[int]:
        text = apply_chat_template(self.tokenizer, messages)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues a request (its n samples together). Raises ValueError for bad input."""
        if request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.check_token_ids(self.vocab_size)
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs must be <= {self.config.max_logprobs}, got {params.logprobs}")
        if params.n > self.config.max_n:
            raise ValueError(f"n must be <= {self.config.max_n}, got {params.n}")
        if params.n > self.config.max_num_seqs:  # a prompt's samples are seated together: it could never start
            raise ValueError(f"n must be <= max_num_seqs ({self.config.max_num_seqs}), got {params.n}")
        token_ids = self.encode_prompt(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ContextLengthError(len(token_ids), self.max_model_len)
        room = self.max_model_len - len(token_ids)
        if params.min_tokens > room:
            raise ValueError(
                f"min_tokens ({params.min_tokens}) does not fit: the prompt leaves room for {room} tokens "
                f"of this model's {self.max_model_len}-token context (and KV cache)"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        children = [
            Request(
                request_id if params.n == 1 else f"{request_id}#{i}",
                token_ids,
                params,
                max_tokens=max_tokens,
                eos_token_ids=self.loaded.eos_token_ids,
                seed=None if params.seed is None else params.seed + i,
                arrival_time=arrival_time,
                parent_id=request_id,
                index=i,
            )
            for i in range(params.n)
        ]
        self.scheduler.add_requests(children)
        self._children[request_id] = [c.request_id for c in children]
        if params.detokenize:
            backend_tokenizer = self.tokenizer.backend_tokenizer
            for child in children:
                self._detokenizers[child.request_id] = IncrementalDetokenizer(backend_tokenizer, token_ids, params)

    def abort_request(self, request_id: str) -> list[SequenceDelta]:
        """Ends every sequence of a request; returns their final deltas (finish_reason "abort")."""
        return self._finish_group(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._children)

    # ---- one step ----------------------------------------------------------------------------------

    def step(self) -> list[SequenceDelta]:
        start = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return self._errors_for_stuck_requests()
        try:
            sampled = self._run_and_sample(out)
        except Exception as exc:  # a failed step fails its requests, not the engine
            logger.exception("engine step failed; failing its %d requests", len(out.scheduled))
            ids = {s.request.parent_id for s in out.scheduled}
            return [d for rid in ids for d in self._finish_group(rid, RequestStatus.FINISHED_ERROR, str(exc))]
        progressed = self.scheduler.update(out, {rid: tok for rid, (tok, _) in sampled.items()})
        deltas = [self._delta(r, sampled[r.request_id][1]) for r in progressed]
        self._record_step(progressed, start)
        return deltas

    def _run_and_sample(self, out: SchedulerOutput) -> dict[str, tuple[int, TokenLogprob | None]]:
        logits = self.runner.execute(out.scheduled, self.kv.take_pending_copies())
        sampling = [s.request for s in out.scheduled if s.samples]
        rows = list(range(len(sampling)))
        for row, request in enumerate(list(sampling)):
            siblings = self.scheduler.pending_forks(request)  # parallel samples draw from the same logits
            sampling.extend(siblings)
            rows.extend([row] * len(siblings))
        if not sampling:
            return {}
        if len(rows) > logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        result = self.sampler(logits, sampling)
        return {r.request_id: (t, lp) for r, t, lp in zip(sampling, result.token_ids, result.logprobs)}

    def _delta(self, request: Request, logprob: TokenLogprob | None) -> SequenceDelta:
        if request.times.first_token is None:
            request.times.first_token = time.monotonic()
        token = request.output_token_ids[-1]
        text, stop_string = "", None
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is not None:
            text, stop_string = detokenizer.update([token])
        if stop_string is not None and not request.is_finished:
            request.stop_reason = stop_string
            self.scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
        elif request.is_finished and detokenizer is not None:
            text += detokenizer.flush()
        delta = SequenceDelta(
            request_id=request.parent_id,
            index=request.index,
            new_token_ids=[token],
            new_text=text,
            new_logprobs=None if logprob is None else [logprob],
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
        siblings = self._children.get(request.parent_id)
        if siblings is not None and request.request_id in siblings:
            siblings.remove(request.request_id)
            if not siblings:
                del self._children[request.parent_id]

    def _finish_group(self, request_id: str, status: RequestStatus, error: str | None = None) -> list[SequenceDelta]:
        deltas = []
        for child_id in list(self._children.get(request_id, [])):
            request = self.scheduler.finish(child_id, status)
            if request is None:
                continue
            detokenizer = self._detokenizers.get(child_id)
            delta = SequenceDelta(request_id, request.index, [], detokenizer.flush() if detokenizer else "")
            self._complete(request, delta, error)
            deltas.append(delta)
        return deltas

    def _errors_for_stuck_requests(self) -> list[SequenceDelta]:
        """Nothing could be scheduled although requests wait: fail the head of the queue, not the engine."""
        if not self.scheduler.waiting or self.scheduler.running:
            return []
        head = self.scheduler.waiting[0]
        logger.error("request %s cannot fit the KV cache; failing it", head.request_id)
        return self._finish_group(head.parent_id, RequestStatus.FINISHED_ERROR, "the request does not fit the KV cache")

    def _record_step(self, progressed: list[Request], start: float) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.step_seconds += time.perf_counter() - start
        stats.generation_tokens += len(progressed)
        # A prompt counts once: at its first token (not again after a preemption), not per parallel sample.
        stats.prompt_tokens += sum(r.num_prompt_tokens for r in progressed if r.num_output_tokens == 1 and r.index == 0)
        stats.peak_running = max(stats.peak_running, self.scheduler.num_running)
        slots = (self.kv.num_blocks - self.kv.pool.num_free) * self.kv.block_size
        if slots > stats.peak_kv_slots:
            stats.peak_kv_slots = slots
            stats.peak_kv_tokens = self.kv.num_stored_tokens(self.scheduler.running)

    # ---- convenience -------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()
