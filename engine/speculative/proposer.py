"""What a proposer is: given the sequences about to decode, a guess of each one's next tokens.

The engine verifies every guess in the step's one forward pass of the target model (engine/core/speculation.py)
and keeps the longest prefix the target agrees with, so a wrong guess costs compute, never correctness. The
n-gram proposer (ngram.py) looks back in the sequence's own tokens; a draft model or an EAGLE-style head would
implement the same call with a forward pass of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
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
