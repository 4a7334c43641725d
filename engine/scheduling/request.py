"""A request as the scheduler sees it: tokens so far, how many are computed, where it stands."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import llguidance
import torch

from pagedserve.engine.outputs import TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass
class RequestTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


class Request:
    """One sequence to generate. `n > 1` fans out into n of these at the engine level."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        seed: int | None = None,
        arrival_time: float | None = None,
        parent_id: str | None = None,
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id or request_id  # the caller's id; differs for the n samples of one prompt
        self.index = index  # which of the n samples
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.max_tokens = max_tokens  # already clamped to the room left in the context
        self.eos_token_ids = eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []  # of this request's full blocks, filled by the KV manager
        # LongRoPE: its KV is rotated with the long factors (a long prompt, or recomputed once it grew past the
        # threshold; KVCacheManager.rotates_long).
        self.long_rope = False
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.prompt_logprobs: list[TokenLogprob] = []  # of prompt tokens 1, 2, ... so far (prompt_logprobs set)
        self.times = RequestTimes() if arrival_time is None else RequestTimes(arrival=arrival_time)
        self.generator: torch.Generator | None = None
        self.grammar: llguidance.LLMatcher | None = None  # set by the engine when params.structured_output
        # Speculative decoding: proposals rejected outright in a row, decoding steps left without any, and the
        # recent proposals' acceptance (decayed counts: accepted ones, and trials, a rejection ending each).
        self.speculation_misses = 0
        self.speculation_pause = 0
        self.speculation_accepted = 0.0
        self.speculation_trials = 0.0
        self.speculation_first_kept = 0.0  # verifications whose first proposal was kept (decayed)
        self.speculation_verifications = 0.0
        self.speculation_continued = 0.0  # proposals kept after a kept one, of those verified after one (decayed)
        self.speculation_continuations = 0.0
        if seed is not None:
            self.generator = torch.Generator().manual_seed(seed)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, count: int) -> None:
        """Drops the last `count` output tokens (a finishing sequence's tokens after its stop string)."""
        del self.output_token_ids[len(self.output_token_ids) - count :]
        del self.all_token_ids[len(self.all_token_ids) - count :]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
