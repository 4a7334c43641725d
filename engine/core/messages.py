"""What crosses between the engine's public API and its core, in either direction (picklable dataclasses).
Torch-free, like every module the caller's side imports (tests/test_layering.py holds the list).

The core may run on a thread of the caller's process or in a process of its own (engine/core/process.py):
the messages are the same, so the two differ only in how they travel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pagedserve.engine.outputs import SequenceDelta
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.text.text_tokenizer import TokenizerSpec
from pagedserve.engine.validation import RequestLimits

# ---- to the core ----------------------------------------------------------------------------------------


@dataclass
class AddRequest:
    """A validated request (engine/validation.py): the core runs it as it is."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival: float  # time.monotonic(): one clock for every process on the host


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class ResetPrefixCache:
    reply_id: int


@dataclass
class CollectStats:
    """Reply with the engine's EngineStats, then start them anew if `reset`."""

    reply_id: int
    reset: bool = False


@dataclass
class Shutdown:
    """Abort whatever runs and end the core."""


Command = AddRequest | AbortRequests | ResetPrefixCache | CollectStats | Shutdown

# ---- from the core --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineInfo:
    """What the caller's side learns once the core has loaded its model."""

    model_dir: str
    tokenizer: TokenizerSpec  # the core's tokenizer, for the caller's side to tokenize and render chats with
    trust_message_special_tokens: bool  # EngineConfig's: how chat message text is tokenized
    limits: RequestLimits
    max_queue_time: float | None  # seconds a request may wait to be scheduled (None: no limit)
    request_timeout: float | None  # seconds a request may take in all (None: no limit)
    num_kv_blocks: int
    block_size: int
    device: str
    pid: int  # the core's process
    heartbeat_timeout: float = 5.0  # seconds of silence (heartbeats included) after which the core counts as wedged


@dataclass(frozen=True)
class EngineSnapshot:
    """The core's counters after one iteration, for metrics, the waiting queue's bound and tests."""

    num_running: int = 0
    num_waiting: int = 0
    num_unfinished: int = 0  # requests (of n sequences each) the core holds
    queue_capacity: int = 0  # sequences that may still wait: max_queue_len plus the running batch's free seats
    kv_cache_usage: float = 0.0  # fraction of blocks referenced by requests (idle cached blocks excluded)
    num_free_blocks: int = 0  # free or cached with no reference: what new requests can take
    num_kv_blocks: int = 0  # in all
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    num_preemptions: int = 0
    constrained_requests: int = 0  # requests with structured output (engine/structured/constraints.py's counters)
    grammar_compile_seconds: float = 0.0
    grammar_mask_seconds: float = 0.0
    grammar_mask_wait_seconds: float = 0.0
    jump_forward_tokens: int = 0
    tensor_parallel_size: int = 1
    communication_seconds: float = 0.0  # rank 0's time in tensor-parallel collectives
    # Speculative decoding (engine/core/speculator.py's counters): sequences that verified proposals, tokens
    # proposed, tokens accepted, and per proposal position how many drafts had it accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()


@dataclass
class Ready:
    info: EngineInfo
    snapshot: EngineSnapshot


@dataclass
class StepOutput:
    """One iteration of the core: its deltas, which requests left the waiting queue, and the counters."""

    deltas: list[SequenceDelta]
    snapshot: EngineSnapshot
    admitted: list[str] = field(default_factory=list)  # scheduled for the first time: they wait no more
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (request id, why) the core could not add
    step_seconds: float | None = None  # None: no model step ran
    num_tokens: int = 0  # computed by that step


@dataclass
class Reply:
    reply_id: int
    value: object


@dataclass
class LogRecord:
    """A log record of the core, handed to the caller's logging (one configuration, one format)."""

    record: logging.LogRecord


@dataclass
class Heartbeat:
    """The core's process still runs: sent, when the caller asks (CoreConnection.start), every
    EngineInfo.heartbeat_timeout / HEARTBEATS_PER_TIMEOUT seconds by a thread of its own, steps or not. The
    transport takes it (CoreConnection.last_heard): receive() never returns one."""


HEARTBEATS_PER_TIMEOUT = 10  # beats a wedge must silence before it is noticed: one late beat is no wedge


@dataclass
class CoreFailed:
    """The core could not load, or its loop died; it sends nothing after this."""

    reason: str


CoreMessage = Ready | StepOutput | Reply | LogRecord | CoreFailed
Emitted = CoreMessage | Heartbeat  # what the core sends
