"""The whole-model budget front end of the solver: one choice per block under a memory budget.

Two steps joined by plain data (costs.py): a profile fills a `ModelCost` (bytes and times of
every block under every choice), and `solve_budget` chooses one choice per block so that the predicted peak
fits the budget at the least predicted time, with the dynamic program of NOTE [ Block recurrence ] in
blocks_dp.py. Nothing here touches a tensor, so a profile made on fake tensors plans the same way:

>>> from remat._budget.costs import BlockCost, ModelCost
>>> kept, full = BlockCost(8, 12, 16, 1.0, 2.0), BlockCost(1, 12, 20, 1.0, 3.0)
>>> cost = ModelCost(("0", "1"), ("kept", "full"), ((kept, full), (kept, full)), (0, 0, 4), 0.5)
>>> plan = solve_budget(cost, 22)
>>> [plan.choices[c] for c in plan.choice], plan.peak_bytes, plan.step_time
(['full', 'kept'], 20, 7.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._core.errors import BudgetError
from .._core.units import Budget, format_bytes, parse_budget
from .blocks_dp import evaluate_blocks, least_budget_blocks, solve_blocks
from .costs import BlockCost, ModelCost

__all__ = ["Assignment", "least_assignment", "resolve_budget", "solve_budget"]


@dataclass(frozen=True)
class Assignment:
    """A budget's assignment: one choice per block, with its predicted peak and the two uniform baselines'.

    Not to be confused with `remat.Plan` (rotor's schedule for a chain) or `remat.plan(model)` (a model's sites).

    Attributes:
        cost: the profile the plan was solved on.
        choice: the index into `cost.choices` chosen for each block.
        budget: the budget in bytes.
        peak_bytes, step_time: the plan's predicted peak (bytes) and step time (seconds).
        no_remat, full_remat: `(peak_bytes, step_time)` of every block kept, and of every block fully
            rematerialized (None when a choice is missing from the profile).
        measured: the tracked peak of one real training step with this plan (None until one ran; see
            NOTE [ Checking the plan ] in check.py).
        missed: bytes a measured step of an earlier plan held beyond its prediction, which `peak_bytes` includes
            (0 unless the plan corrects one that went over its budget).
    """

    cost: ModelCost
    choice: tuple[int, ...]
    budget: int
    peak_bytes: int
    step_time: float
    no_remat: tuple[int, float] | None
    full_remat: tuple[int, float] | None
    measured: int | None = None
    missed: int = 0

    @property
    def choices(self) -> tuple[str, ...]:
        """The labels of the choices, indexed by `choice`."""
        return self.cost.choices

    def block(self, i: int) -> tuple[str, str, BlockCost, float]:
        """Block i's name, choice, cost, and extra time over keeping it (0 when it cannot be kept)."""
        row = self.cost.blocks[i]
        chosen = row[self.choice[i]]
        assert chosen is not None
        kept = row[0] if self.cost.choices[0] == "kept" else None
        extra = chosen.time - kept.time if kept is not None else 0.0
        return self.cost.names[i], self.cost.choices[self.choice[i]], chosen, extra

    def time(self, seconds: float, extra: bool = False) -> str:
        """A predicted time as the plan says it: milliseconds where they were measured on this device; where the
        profile priced ops on a nominal device (fake tensors: NOTE [ Priced time ]), relative to the step without
        remat, which is all those prices can say."""
        base = self.no_remat[1] if self.no_remat is not None else None
        if not self.cost.priced or not base:
            return f"{seconds * 1e3:+.2f} ms" if extra else f"{seconds * 1e3:.1f} ms"
        if extra:
            return f"{seconds / base:+.1%}"
        return f"{seconds / base:.2f}x no remat's"

    def summary(self) -> list[str]:
        """The plan's figures as lines: predicted peak and time, and the two baselines."""
        lines = [
            f"predicted peak {format_bytes(self.peak_bytes)} (budget {format_bytes(self.budget)}), "
            f"step {self.time(self.step_time)}"
        ]
        if self.measured is not None:
            lines.append(f"measured peak of one real step {format_bytes(self.measured)} "
                         f"({self.measured / self.budget:.2f} of the budget)")
        else:
            lines.append("not measured yet: the model's first training step checks this plan")
        if self.missed:
            lines.append(f"re-planned after a measured step went over the budget: the prediction counts "
                         f"{format_bytes(self.missed)} it had missed")
        for label, figures in (("no remat", self.no_remat), ("full remat", self.full_remat)):
            if figures is not None:
                lines.append(f"{label}: peak {format_bytes(figures[0])}, step {self.time(figures[1])}")
        if self.cost.priced:
            lines.append("times are relative to no remat's step: planned on fake tensors, ops priced on a nominal "
                         "device rather than timed on this one")
        return lines


def _uniform(cost: ModelCost, label: str) -> tuple[int, float] | None:
    if label not in cost.choices:
        return None
    c = cost.choices.index(label)
    if any(row[c] is None for row in cost.blocks):
        return None
    return evaluate_blocks(cost, [c] * len(cost))


def resolve_budget(budget: Budget, cost: ModelCost) -> int:
    """Bytes for `budget`: as given, or a fraction of the predicted peak of keeping every block.

    Raises:
        ValueError: a fraction was given but the profile has no "kept" choice for every block.
    """
    value = parse_budget(budget)
    if isinstance(value, int):
        return value
    base = _uniform(cost, "kept")
    if base is None:
        raise ValueError(
            "remat: a fractional budget is a fraction of the activation peak without remat, which this profile "
            "lacks (no 'kept' choice for every block); give the budget in bytes instead."
        )
    return max(1, math.floor(value * base[0]))


def solve_budget(cost: ModelCost, budget: Budget, *, slots: int = 4096) -> Assignment:
    """Choose one option per block so that the predicted peak fits `budget` at the least predicted time.

    Args:
        cost: the profile (see NOTE [ Budget model ] in costs.py).
        budget: bytes (an int, or a string with a unit such as "1.5GiB"), or a float in (0, 1]: that
            fraction of the predicted activation peak with every block kept.
        slots: the largest Pareto front kept per block before sizes are rounded (NOTE [ Block recurrence ]).

    Returns:
        The `Assignment`; its `peak_bytes` is at most the budget.

    Raises:
        BudgetError: no choice per block fits; the message names the smallest budget that does.
    """
    nbytes = resolve_budget(budget, cost)
    least, least_choice = least_budget_blocks(cost)
    if nbytes < least:
        asked = f"{budget!r} = {nbytes} bytes" if not isinstance(budget, int) else f"{nbytes} bytes"
        raise BudgetError(
            f"remat: no choice per block of these {len(cost)} blocks fits a budget of {asked} "
            f"({format_bytes(nbytes)}) under the profile; the smallest feasible budget is {least} bytes "
            f"({format_bytes(least)}). Raise the budget to at least that, or add choices that keep less.",
            least_bytes=least,
        )
    found = solve_blocks(cost, nbytes, slots=slots)
    candidates = [found[0]] if found is not None else []
    candidates.append(least_choice)
    for c in range(len(cost.choices)):
        if all(row[c] is not None for row in cost.blocks):
            candidates.append(tuple([c] * len(cost)))
    scored = [(evaluate_blocks(cost, ch), ch) for ch in candidates]
    fits = [(time, peak, ch) for (peak, time), ch in scored if peak <= nbytes]
    time, peak, choice = min(fits, key=lambda item: item[0])  # min keeps the first of equals: the DP's
    return Assignment(cost, tuple(choice), nbytes, peak, time, _uniform(cost, "kept"), _uniform(cost, "full"))


def least_assignment(cost: ModelCost, budget: Budget) -> Assignment:
    """The choice per block with the least predicted peak, under `budget` (which it may not fit)."""
    choice = least_budget_blocks(cost)[1]
    peak, time = evaluate_blocks(cost, choice)
    return Assignment(cost, choice, resolve_budget(budget, cost), peak, time, _uniform(cost, "kept"),
                      _uniform(cost, "full"))
