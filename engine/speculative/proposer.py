"""What a proposer is: given the sequences about to decode, a guess of each one's next tokens.

The engine verifies every guess in the step's one forward pass of the target model (engine/core/speculation.py)
and keeps the longest prefix the target agrees with, so a wrong guess costs compute, never correctness. The
n-gram proposer (ngram.py) looks back in the sequence's own tokens; the draft-model proposer (draft.py) runs a
model of its own, with a KV cache that follows the sequences; an EAGLE-style head would implement the same calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class ProposalContext(Protocol):
    """The parts of a sequence a proposer reads (engine/scheduling's Request satisfies it)."""

    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> list[int]: ...


class Proposer(Protocol):
    def propose(self, sequences: Sequence[ProposalContext], max_tokens: Sequence[int]) -> list[list[int]]:
        """For each sequence, up to max_tokens[i] tokens that may follow its tokens (none: no guess)."""
        ...

    def release(self, request_ids: Iterable[str]) -> None:
        """The sequences left the running batch (finished, aborted or preempted): drop what is kept for them.
        A preempted one that comes back is new to the proposer."""
        ...
