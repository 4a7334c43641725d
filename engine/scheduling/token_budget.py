"""What a request's next tokens cost of a step's token budget."""

from __future__ import annotations

from pagedserve.engine.outputs import scored_positions
from pagedserve.engine.scheduling.request import Request


def fit(request: Request, num_computed: int, budget: int) -> tuple[int, int]:
    """How many of the request's next tokens this step takes, and what they cost of the token budget.

    A token costs one; a prompt token whose position is scored (prompt logprobs) costs two: its forward row, and
    its row through the LM head and the log-softmax, top-k and rank passes over the vocabulary, which costs less
    than a forward row. So a scoring step never takes longer than a full-budget step: a long prompt's scoring
    spreads over more, shorter steps, and the other requests' tokens come between them. At least one token, to
    progress (a budget of one then takes two).
    """
    remaining = request.num_tokens - num_computed
    num_new = min(remaining, budget)
    if request.params.prompt_logprobs is None:
        return num_new, num_new
    window = scored_positions(num_computed, remaining, len(request.prompt_logprobs), request.num_prompt_tokens)
    if not window:
        return num_new, num_new
    before = window.start - num_computed
    segments = [(before, 1), (len(window), 2), (remaining - before - len(window), 1)]  # (tokens, cost of each)
    taken, left = 0, budget
    for length, cost in segments:
        take = min(length, left // cost)
        taken, left = taken + take, left - take * cost
        if take < length:
            break
    if taken == 0:  # a budget of one and a scored token next
        return 1, 2
    return taken, budget - left
