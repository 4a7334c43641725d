"""The draft model's KV blocks: a free list, and each followed sequence's blocks and what they hold.

A sequence's draft KV holds its tokens up to the last proposal round, then the KV of that round's proposals
but the last. What of that the target kept stays valid; the rest (rejected positions) is overwritten by the
next round's catch-up, and blocks past what the sequence needs go back to the pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class DraftState:
    blocks: list[int] = field(default_factory=list)
    num_known: int = 0  # the sequence's tokens when it last proposed: their KV is written
    proposed: list[int] = field(default_factory=list)  # proposals after them whose KV is written too

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of the sequence the draft's KV holds: the known ones, then the proposals the
        target accepted (at most all but the last token, whose logits the next round needs)."""
        num_valid = min(self.num_known, len(token_ids) - 1)
        if num_valid == self.num_known:
            for proposal, token in zip(self.proposed, token_ids[self.num_known : len(token_ids) - 1]):
                if proposal != token:
                    break
                num_valid += 1
        return num_valid


class DraftBlocks:
    """Block tables of the draft's own cache (the runner reads them by sequence id, as it reads the target's)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.states: dict[str, DraftState] = {}

    def block_ids(self, request_id: str) -> list[int]:
        return self.states[request_id].blocks

    def state(self, request_id: str) -> DraftState:
        return self.states.setdefault(request_id, DraftState())

    def fit(self, request_id: str, num_slots: int) -> bool:
        """Gives the sequence exactly the blocks `num_slots` tokens need (taking or returning some); False when
        the pool is short (its blocks stay as they were: it does not propose this round)."""
        blocks = self.state(request_id).blocks
        needed = -(-num_slots // self.block_size)
        if needed - len(blocks) > len(self.free):
            return False
        while len(blocks) < needed:
            blocks.append(self.free.pop())
        while len(blocks) > needed:
            self.free.append(blocks.pop())
        return True

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self.free += state.blocks
