"""The verification of a plan's slack (NOTE [ Verifying the plan ] in remat/_budget/verify.py, rule 4): a budget's
least choice may measure a little over it; `memory=`'s may not (going over is an out-of-memory error)."""

from __future__ import annotations

from typing import Any

import pytest

from remat._budget.costs import BlockCost, ModelCost
from remat._budget.regimes import BudgetRegime, MemoryRegime
from remat._budget.solve import Assignment, solve_budget
from remat._budget.verify import SLACK, verify
from remat._core.errors import BudgetError


def _full_remat_plan() -> Assignment:
    """Two blocks, each kept (16 bytes at its peak) or fully rematerialized (8): planned for 1,000, full remat."""
    kept, full = BlockCost(800, 1200, 1600, 1.0, 2.0), BlockCost(100, 400, 800, 1.0, 3.0)
    cost = ModelCost(("0", "1"), ("kept", "full"), ((kept, full), (kept, full)), (0, 0, 0), 0.5)
    plan = solve_budget(cost, 1000)
    assert plan.choice == (1, 1)
    return plan


def test_the_least_choice_a_little_over_its_budget_is_kept_with_the_budgets_slack() -> None:
    plan = _full_remat_plan()
    measured = int(plan.budget * (1 + (SLACK - 1) / 2))  # over, within the slack
    assert measured > plan.budget
    assert verify(plan, lambda a: measured, lambda a: None).measured == measured
    with pytest.raises(BudgetError):
        verify(plan, lambda a: measured, lambda a: None, slack=1.0)


def test_memorys_regime_verifies_without_slack() -> None:
    seen: list[float] = []

    class Inner(BudgetRegime):
        def verify(self, assignment: Assignment, measure: Any, place: Any, slack: float = SLACK) -> Assignment:
            seen.append(slack)
            return assignment

    plan = _full_remat_plan()
    request: Any = None
    MemoryRegime(Inner(request)).verify(plan, lambda a: 0, lambda a: None)
    assert seen == [1.0]
