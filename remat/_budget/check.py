"""A budget's plan is checked on real tracked steps, and corrected if one went over.

NOTE [ Checking the plan ]
A plan's peak is a prediction (NOTE [ Budget model ] in costs.py); the promise is about the real step: a plan's
measured peak is at most the budget (with `SLACK`), or `BudgetError` says the least budget that can be met.

Rules:
1. A plan is checked on real tracked steps. The peak, above what was live before the step with the gradients
   already there, is the quantity the budget refers to; `remat.plan(model)` shows it beside the prediction.
2. Where the prediction fits the budget, the check is the model's first training step (NOTE [ The first step ] in
   first_step.py), and planning is the profile alone. Elsewhere `remat.apply(model, budget=...)` (and every
   re-plan) runs one more training step on the sample under `remat.track()` before it returns, leaving the model
   as it found it (gradients, buffers, RNG streams), as the profile does.
3. A step over the budget corrects the plan: it is solved again on the same profile for the budget less what the
   prediction missed (measured minus predicted, taken as bytes the model does not see), and checked again on the
   next step, at most `CHECKS` steps in all (`AssignmentCheck`).
4. Only a measured step may refuse a budget: a budget below the least predicted peak is not refused on the
   prediction alone. Where nothing the profile offers fits, full remat of every block is checked, and if even
   that measures over the slack, `BudgetError` names its measured peak as the least budget.

Implementation notes:
1. (rule 2) The check runs before `remat.apply` returns where the prediction does not fit, with `memory=`, for a
   model planned as one compiled graph, for a model sharded by `fully_shard`, and in `remat.estimate` (on fake
   tensors, the plan a real model ends with once its first step has checked it).
2. (rule 2) With `remat.apply(model, memory=...)` the budget is what the step's state leaves, and gradients take
   from it too: its checked step starts without gradients (NOTE [ Total memory ] in remat/_estimate/memory.py).
3. (rule 4) Below the least predicted peak, the choice that holds least is checked, and kept if it measures
   within the budget. "Full remat of every block" is where the profile has it; else the choice predicted to hold
   least.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .._core.errors import BudgetError
from .._core.units import format_bytes
from .blocks_dp import evaluate_blocks
from .solve import Assignment, least_assignment, solve_budget

__all__ = ["CHECKS", "SLACK", "AssignmentCheck", "check_assignment", "check_measured"]

CHECKS = 3
SLACK = 1.05


def _corrected(plan: Assignment, measured: int, *, both: bool = False) -> Assignment | None:
    """The plan for the budget less what `plan`'s prediction missed, or None where none fits that. With `both`,
    a prediction over the measured peak counts too (a negative miss: NOTE [ Planned on measured steps ])."""
    missed = plan.missed + (measured - plan.peak_bytes if both else max(0, measured - plan.peak_bytes))
    target = plan.budget - missed
    try:
        found = solve_budget(plan.cost, target) if target > 0 else None
    except BudgetError:
        found = None
    if found is None or found.choice == plan.choice:
        return None
    return dataclasses.replace(found, budget=plan.budget, peak_bytes=found.peak_bytes + missed, missed=missed)


def _least(plan: Assignment) -> Assignment:
    """Full remat of every block where the profile has it (what the promise is measured against), else the
    choice per block the profile predicts to hold least."""
    least = least_assignment(plan.cost, plan.budget)
    if "full" in plan.cost.choices and all(row[plan.cost.choices.index("full")] for row in plan.cost.blocks):
        full = plan.cost.choices.index("full")
        peak, time = evaluate_blocks(plan.cost, [full] * len(plan.cost))
        return dataclasses.replace(least, choice=(full,) * len(plan.cost), peak_bytes=peak, step_time=time)
    return least


class AssignmentCheck:
    """The checks of one plan, one measured step at a time (NOTE [ Checking the plan ]).

    `after(measured)` takes the peak of a step run with `plan` on the blocks and returns the plan to put on them
    and measure next, or None once `plan` is final: measured within the budget, or within its slack once nothing
    else is left to try.
    """

    def __init__(self, plan: Assignment) -> None:
        self.plan = plan
        self._tried: set[tuple[int, ...]] = set()
        self._left = CHECKS
        self._floor = False  # whether `plan` is the choice that holds least, measured last

    def after(self, measured: int) -> Assignment | None:
        """Record the peak of a step of `plan`; the plan to measure next, or None when `plan` is final.

        Raises:
            BudgetError: even the choice that holds least measured over the budget's slack.
        """
        plan = self.plan = dataclasses.replace(self.plan, measured=measured)
        self._tried.add(plan.choice)
        slack = plan.budget * SLACK
        if measured <= plan.budget or (self._floor and measured <= slack):
            return None
        if self._floor:
            raise _refused(plan, measured)
        self._left -= 1
        least = _least(plan)
        if self._left > 0:
            following = _corrected(plan, measured)
            if following is None or following.choice in self._tried:
                following = None if least.choice in self._tried else least
            if following is not None:
                self.plan = following
                return following
        if measured <= slack:
            return None
        if least.choice == plan.choice:
            raise _refused(plan, measured)
        self._floor = True
        self.plan = least
        return least


def _refused(plan: Assignment, floor: int) -> BudgetError:
    return BudgetError(
        f"remat: no choice per block of these {len(plan.cost)} blocks fits a budget of {plan.budget} bytes "
        f"({format_bytes(plan.budget)}) in a real step: the one that holds least measured {floor} bytes "
        f"({format_bytes(floor)}); the smallest feasible budget is {floor} bytes. Raise the budget to at least that.",
        least_bytes=floor,
    )


def check_assignment(
    plan: Assignment, measure: Callable[[], int], assign: Callable[[Assignment], None]
) -> Assignment:
    """Measure `plan` (already assigned) and correct it until a step fits (NOTE [ Checking the plan ]).

    Args:
        plan: the solved plan, on the blocks.
        measure: runs one tracked step of the model as it now is and returns its peak.
        assign: puts a plan's choices on the blocks.

    Raises:
        BudgetError: even the choice that holds least measured over the budget's slack.
    """
    check = AssignmentCheck(plan)
    while (following := check.after(measure())) is not None:
        assign(following)
    return check.plan


# NOTE [ Planned on measured steps ]
# A plan for one compiled graph is checked on real compiled steps (NOTE [ Measuring a compiled step ] in
# remat/_measure/step_peak.py), while its profile is an eager one: eager code's backward allocates what compiled code
# fuses away, so the profile predicts more than compiled code holds (docs/benchmarks.md has a case), and a plan solved
# on it keeps less than the budget allows. So there the model's miss is taken both ways: each measured step moves the
# target by what its prediction missed, over or under, and the plan solved for that target is measured next, while it is
# predicted faster than the fastest plan measured within the budget so far; at most `CHECKS` + 1 steps. The plan kept is
# the fastest measured within the budget; where none was, the checks go on as in NOTE [ Checking the plan ] (full remat
# measured last, `BudgetError` if even that is over the slack).


def check_measured(
    plan: Assignment, measure: Callable[[], int], assign: Callable[[Assignment], None]
) -> Assignment:
    """`check_assignment` with the prediction's miss taken both ways (NOTE [ Planned on measured steps ]).

    Raises:
        BudgetError: even the choice that holds least measured over the budget's slack.
    """
    tried: set[tuple[int, ...]] = set()
    best: Assignment | None = None
    for _ in range(CHECKS + 1):
        measured = measure()
        plan = dataclasses.replace(plan, measured=measured)
        tried.add(plan.choice)
        if measured <= plan.budget and (best is None or plan.step_time < best.step_time):
            best = plan
        following = _corrected(plan, measured, both=True)
        if following is None or following.choice in tried or (best and following.step_time >= best.step_time):
            break
        plan = following
        assign(plan)
    if best is None:  # none measured within the budget: the least, measured last
        least = _least(plan)
        if least.choice != plan.choice:
            assign(least)
            plan = dataclasses.replace(least, measured=measure())
        if plan.measured is None or plan.measured > plan.budget * SLACK:
            raise _refused(plan, plan.measured or 0)
        return plan
    if best.choice != plan.choice:
        assign(best)
    return best
