"""What a decoding step costs by its query tokens, measured as the engine runs, and how many proposals to verify.

Speculation pays when the tokens a verifying step is expected to keep outweigh what its extra query rows cost.
That cost depends on the machine and the kernels: on the CPU's block formats a row more costs anywhere from a
tenth to most of a one-token step, by the format, the row count (the integer tiles take up to 8 tokens at once)
and the CPU, so no constant holds everywhere. `StepCosts` keeps the median of the last few wall-clock times of
decode-only steps by their token count, and `plan_proposals` hands out proposals one at a time to the sequence
whose next one is likeliest accepted, while the expected tokens a second of the step still grow.

A size not yet measured is priced from the nearest measured one at PRIOR_ROW_COST of a one-token step a row;
every EXPLORE_EVERY steps the plan takes one more proposal than it would, so that a size once measured slow
(on a busy moment) is measured again rather than avoided for good.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

SAMPLES = 8  # recent times kept a size: their median shrugs off a step that a busy moment slowed
PRIOR_ROW_COST = 0.5  # an unmeasured row's cost, as a share of a one-token step
EXPLORE_EVERY = 16  # planned steps between two that try one proposal more than the plan


class StepCosts:
    """Recent wall-clock seconds of decode-only steps, by their query tokens."""

    def __init__(self) -> None:
        self._seconds: dict[int, deque[float]] = {}

    def record(self, tokens: int, seconds: float) -> None:
        self._seconds.setdefault(tokens, deque(maxlen=SAMPLES)).append(seconds)

    def cost(self, tokens: int) -> float | None:
        """The step's expected seconds (None before any step was measured)."""
        if tokens in self._seconds:
            return statistics.median(self._seconds[tokens])
        if not self._seconds:
            return None
        nearest = min(self._seconds, key=lambda size: (abs(size - tokens), size))
        measured = statistics.median(self._seconds[nearest])
        # Scaled along the prior line c(n) ~ 1 + PRIOR_ROW_COST * (n - 1) through the nearest measured size.
        return measured * (1 + PRIOR_ROW_COST * (tokens - 1)) / (1 + PRIOR_ROW_COST * (nearest - 1))


def plan_proposals(
    chances: Sequence[Sequence[float]], base_rows: int, costs: StepCosts, explore: bool = False
) -> list[int]:
    """Proposals for each candidate sequence: one at a time to the candidate whose next proposal is likeliest
    kept (chances[i][j]: that candidate i's proposal j is, the ones before it kept too; as many as it may
    propose), while the step's expected tokens a second grow. `base_rows`: the step's query tokens without
    proposals (one a decoding sequence). `explore`: one proposal more than that, where any is left."""
    planned = [0] * len(chances)
    rows, tokens = base_rows, float(base_rows)
    while True:
        open_ = [i for i in range(len(planned)) if planned[i] < len(chances[i])]
        if not open_:
            return planned
        best = max(open_, key=lambda i: chances[i][planned[i]])
        gain = chances[best][planned[best]]
        now, more = costs.cost(rows), costs.cost(rows + 1)
        pays = now is None or more is None or (tokens + gain) * now > tokens * more
        if not pays and not explore:
            return planned
        explore = explore and pays
        planned[best] += 1
        rows, tokens = rows + 1, tokens + gain
