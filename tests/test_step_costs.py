"""How many proposals a step verifies, from measured step costs (engine/core/step_costs.py)."""

from __future__ import annotations

import pytest

from pagedserve.engine.core.step_costs import PRIOR_ROW_COST, SAMPLES, StepCosts, plan_proposals


def geometric(chance: float, proposals: int) -> list[float]:
    """The chances that each of `proposals` proposals is kept, each kept with `chance` after the one before."""
    return [chance ** (j + 1) for j in range(proposals)]


def costs_of(seconds_by_tokens: dict[int, float]) -> StepCosts:
    costs = StepCosts()
    for tokens, seconds in seconds_by_tokens.items():
        costs.record(tokens, seconds)
    return costs


def test_a_size_costs_the_median_of_its_recent_steps() -> None:
    costs = StepCosts()
    for seconds in (0.010, 0.011, 0.500, 0.012):  # one step slowed by a busy moment
        costs.record(1, seconds)
    assert costs.cost(1) == pytest.approx(0.0115)
    for _ in range(SAMPLES):  # only the recent ones count
        costs.record(1, 0.020)
    assert costs.cost(1) == pytest.approx(0.020)


def test_an_unmeasured_size_is_priced_from_the_nearest_measured_one() -> None:
    assert StepCosts().cost(3) is None
    costs = costs_of({1: 0.010})
    assert costs.cost(3) == pytest.approx(0.010 * (1 + 2 * PRIOR_ROW_COST))
    costs.record(5, 0.040)
    assert costs.cost(4) == pytest.approx(0.040 * (1 + 3 * PRIOR_ROW_COST) / (1 + 4 * PRIOR_ROW_COST))
    assert costs.cost(2) == pytest.approx(0.010 * (1 + PRIOR_ROW_COST))


def test_proposals_go_while_the_expected_tokens_a_second_grow() -> None:
    # Rows are cheap up to 4 tokens and dear after: a well-guessed sequence verifies 3 proposals, not its 4.
    costs = costs_of({1: 0.010, 2: 0.012, 3: 0.014, 4: 0.016, 5: 0.030})
    assert plan_proposals([geometric(0.9, 4)], 1, costs) == [3]
    # Every row costs a whole step: nothing pays.
    costs = costs_of({n: 0.010 * n for n in range(1, 6)})
    assert plan_proposals([geometric(0.9, 4)], 1, costs) == [0]
    # Free rows: every proposal, up to each sequence's limit.
    costs = costs_of({n: 0.010 for n in range(1, 9)})
    assert plan_proposals([geometric(0.9, 4), geometric(0.5, 2)], 2, costs) == [4, 2]


def test_the_likeliest_proposals_go_first() -> None:
    # Two sequences, room for two rows that pay: the well-guessed one takes both (0.9, 0.81 beat 0.3).
    costs = costs_of({2: 0.010, 3: 0.011, 4: 0.012, 5: 0.030})
    assert plan_proposals([geometric(0.3, 4), geometric(0.9, 4)], 2, costs) == [0, 2]


def test_before_any_measurement_every_proposal_goes_and_exploring_adds_one() -> None:
    assert plan_proposals([geometric(0.1, 4)], 1, StepCosts()) == [4]
    costs = costs_of({n: 0.010 * n for n in range(1, 6)})
    assert plan_proposals([geometric(0.9, 4)], 1, costs, explore=True) == [1]
    assert plan_proposals([[]], 1, costs, explore=True) == [0]  # no room: nothing to explore
