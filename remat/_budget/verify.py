"""Stage 4, verify: an assignment's prediction is verified on real tracked steps, and corrected where one went over.

NOTE [ Verifying the plan ]
An assignment's peak is a prediction (NOTE [ Budget model ] in costs.py); the promise is about the real step: its
measured peak is at most the budget (with `SLACK`), or `BudgetError` says the least budget that can be met.

Rules:
1. An assignment is verified on real tracked steps. The peak, above what was live before the step with the
   gradients already there, is the quantity the budget refers to; `remat.plan(model)` shows it beside the
   prediction.
2. Where the prediction fits the budget and the mode allows it, the verification is the model's first training
   step (NOTE [ The first step ] in first_step.py), and planning is the profile alone. Elsewhere
   `remat.apply(model, budget=...)` (and every re-plan) runs one more training step on the sample under
   `remat.track()` before it returns, leaving the model as it found it (gradients, buffers, RNG streams), as the
   profile does.
3. A step over the budget corrects the assignment: it is solved again on the same costs for the budget less what
   the prediction missed (measured minus predicted, taken as bytes the model does not see), and verified again on
   the next step, at most `STEPS` steps in all (`Verification`).
4. Only a measured step may refuse a budget: a budget below the least predicted peak is not refused on the
   prediction alone. Where nothing the costs offer fits, full remat of every block is verified, and if even that
   measures over the slack, `BudgetError` names its measured peak as the least budget. Under `memory=` there is no
   slack: going over is an out-of-memory error (`MemoryRegime` in regimes.py), and the refusal takes the open
   choices next (the head, tiles, offload: NOTE [ The head as a choice ] in head_choice.py).

Implementation notes:
1. (rule 2) The regimes that verify before `remat.apply` returns (regimes.py): a prediction that does not fit,
   `memory=`, one compiled graph, a model sharded by `fully_shard`, and `remat.estimate` (on fake tensors, the
   assignment a real model ends with once its first step has verified it).
2. (rule 2) With `remat.apply(model, memory=...)` the budget is what the step's state leaves, and gradients take
   from it too: its verified step starts without gradients (NOTE [ Total memory ] in remat/_apply/memory.py).
3. (rule 4) Below the least predicted peak, the choice that holds least is verified, and kept if it measures
   within the budget. "Full remat of every block" is where the costs have it; else the choice predicted to hold
   least.

NOTE [ The same plan on every rank ]
1. Under data parallelism (DDP, FSDP2) every rank runs rank 0's plan: ranks planned alike compute alike in memory
   and speed, and the budget was given once for all of them.
2. The real step that verifies the plan (NOTE [ Verifying the plan ]) counts the highest peak of any rank, so every
   rank corrects it alike.
3. Nothing happens without an initialised default group of more than one rank, or on torch's fake process group
   (an estimate's: one process plays one rank).

Implementation notes:
1. (rule 1) Every rank runs the profile step (its collectives need every rank), and timings differ a little from
   rank to rank, so solvers could choose differently; after solving, every rank takes rank 0's assignment with
   `broadcast_object_list` over the default process group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from .._core.errors import BudgetError
from .._core.units import format_bytes
from .solve import Assignment, evaluate_blocks, least_assignment, solve_budget

__all__ = ["SLACK", "STEPS", "Measure", "Verification", "from_rank_zero", "max_over_ranks", "verify",
           "verify_both_ways"]

Measure = Callable[[Assignment], int]  # the peak of one real step with an assignment on the blocks

STEPS = 3
"""How many real steps a verification measures at most (NOTE [ Verifying the plan ], rule 3)."""

SLACK = 1.05
"""How far over its budget the choice that holds least may measure and be kept (rule 4)."""


def _corrected(assignment: Assignment, measured: int, *, both: bool = False) -> Assignment | None:
    """The assignment for the budget less what `assignment`'s prediction missed, or None where none fits that.
    With `both`, a prediction over the measured peak counts too (a negative miss: NOTE [ Planned on measured
    steps ])."""
    over = measured - assignment.peak_bytes
    missed = assignment.missed + (over if both else max(0, over))
    target = assignment.budget - missed
    try:
        found = solve_budget(assignment.cost, target) if target > 0 else None
    except BudgetError:
        found = None
    if found is None or found.choice == assignment.choice:
        return None
    return dataclasses.replace(found, budget=assignment.budget, peak_bytes=found.peak_bytes + missed, missed=missed)


def _least_choice(assignment: Assignment) -> Assignment:
    """Full remat of every block where the costs have it (what the promise is measured against), else the choice
    per block the costs predict to hold least (implementation note 3)."""
    cost = assignment.cost
    least = least_assignment(cost, assignment.budget)
    if "full" in cost.choices and all(row[cost.choices.index("full")] for row in cost.blocks):
        full = cost.choices.index("full")
        peak, time = evaluate_blocks(cost, [full] * len(cost))
        return dataclasses.replace(least, choice=(full,) * len(cost), peak_bytes=peak, step_time=time)
    return least


class Verification:
    """The verification of one assignment, one measured step at a time (NOTE [ Verifying the plan ]).

    `after(measured)` takes the peak of a step run with `assignment` on the blocks and returns the assignment to
    put on them and measure next, or None once `assignment` is final: measured within the budget, or within its
    slack once nothing else is left to try.
    """

    def __init__(self, assignment: Assignment, slack: float = SLACK) -> None:
        self.assignment = assignment
        self.slack = slack
        self._tried: set[tuple[int, ...]] = set()
        self._left = STEPS
        self._floor = False  # whether `assignment` is the choice that holds least, measured last

    def after(self, measured: int) -> Assignment | None:
        """Record the peak of a step of `assignment`; the assignment to measure next, or None when it is final.

        Raises:
            BudgetError: even the choice that holds least measured over the budget's slack.
        """
        assignment = self.assignment = dataclasses.replace(self.assignment, measured=measured)
        self._tried.add(assignment.choice)
        slack = assignment.budget * self.slack
        if measured <= assignment.budget or (self._floor and measured <= slack):
            return None
        if self._floor:
            raise _refusal(assignment, measured)
        self._left -= 1
        least = _least_choice(assignment)
        if self._left > 0:
            following = _corrected(assignment, measured)
            if following is None or following.choice in self._tried:
                following = None if least.choice in self._tried else least
            if following is not None:
                self.assignment = following
                return following
        if measured <= slack:
            return None
        if least.choice == assignment.choice:
            raise _refusal(assignment, measured)
        self._floor = True
        self.assignment = least
        return least


def _refusal(assignment: Assignment, floor: int) -> BudgetError:
    budget = assignment.budget
    return BudgetError(
        f"remat: no choice per block of these {len(assignment.cost)} blocks fits a budget of {budget} bytes "
        f"({format_bytes(budget)}) in a real step: the one that holds least measured {floor} bytes "
        f"({format_bytes(floor)}); the smallest feasible budget is {floor} bytes. Raise the budget to at least that.",
        least_bytes=floor,
    )


def verify(assignment: Assignment, measure: Measure, place: Callable[[Assignment], None],
           slack: float = SLACK) -> Assignment:
    """Measure `assignment` (already on the blocks) and correct it until a step fits (NOTE [ Verifying the plan ]).

    Args:
        assignment: the solved assignment, on the blocks.
        measure: runs one tracked step of the model with an assignment on its blocks and returns its peak.
        place: puts an assignment's choices on the blocks.
        slack: how far over the budget the choice that holds least may measure and be kept (`SLACK`; 1.0 where
            going over is an out-of-memory error: `memory=`).

    Raises:
        BudgetError: even the choice that holds least measured over the budget's slack.
    """
    verification = Verification(assignment, slack)
    while (following := verification.after(measure(verification.assignment))) is not None:
        place(following)
    return verification.assignment


# NOTE [ Planned on measured steps ]
# 1. An assignment for one compiled graph is verified on real compiled steps (NOTE [ Measuring a compiled step ] in
#    remat/_measure/step_peak.py), while its costs are an eager profile's: eager code's backward allocates what
#    compiled code fuses away, so the costs predict more than compiled code holds (docs/benchmarks.md has a case),
#    and an assignment solved on them keeps less than the budget allows.
# 2. So there the prediction's miss is taken both ways: each measured step moves the target by what its prediction
#    missed, over or under, and the assignment solved for that target is measured next while it is predicted faster
#    than the fastest one measured within the budget so far; at most `STEPS` + 1 steps.
# 3. The assignment kept is the fastest measured within the budget; where none was, the verification goes on as in
#    NOTE [ Verifying the plan ] (full remat measured last, `BudgetError` if even that is over the slack).


def verify_both_ways(assignment: Assignment, measure: Measure, place: Callable[[Assignment], None],
                     slack: float = SLACK) -> Assignment:
    """`verify` with the prediction's miss taken both ways (NOTE [ Planned on measured steps ]).

    Raises:
        BudgetError: even the choice that holds least measured over the budget's slack.
    """
    tried: set[tuple[int, ...]] = set()
    best: Assignment | None = None
    for _ in range(STEPS + 1):
        measured = measure(assignment)
        assignment = dataclasses.replace(assignment, measured=measured)
        tried.add(assignment.choice)
        if measured <= assignment.budget and (best is None or assignment.step_time < best.step_time):
            best = assignment
        following = _corrected(assignment, measured, both=True)
        if following is None or following.choice in tried or (best and following.step_time >= best.step_time):
            break
        assignment = following
        place(assignment)
    if best is None:  # none measured within the budget: the least, measured last
        least = _least_choice(assignment)
        if least.choice != assignment.choice:
            place(least)
            assignment = dataclasses.replace(least, measured=measure(least))
        if assignment.measured is None or assignment.measured > assignment.budget * slack:
            raise _refusal(assignment, assignment.measured or 0)
        return assignment
    if best.choice != assignment.choice:
        place(best)
    return best


# -- one assignment for every rank: NOTE [ The same plan on every rank ] -------------------------------------------

T = TypeVar("T")


def _spread() -> bool:
    """Whether a default process group of more than one real rank is initialised."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return False
    return dist.get_backend() != "fake"


def from_rank_zero(value: T) -> T:
    """``value`` as rank 0 has it, on every rank of the default process group (``value`` itself without one)."""
    if not _spread():
        return value
    box: list[object] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def max_over_ranks(value: int) -> int:
    """The largest of ``value`` over the ranks of the default process group (``value`` itself without one)."""
    if not _spread():
        return value
    values: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return max(v for v in values if isinstance(v, int))
