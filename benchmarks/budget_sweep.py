"""The budget sweep: `remat.apply(model, budget=f * no remat's peak, sample=...)` on seven workloads, f = 0.2..0.9.

Per workload and fraction f: the budget (f times the measured activation peak without remat), the measured peak
of one real step of the planned model under `remat.track()` over the budget, whether `remat.apply` refused
(`BudgetError`, with its `least_bytes` against full remat's measured peak: a refusal is false when full remat of
every block meets the budget), the step time, and the fastest uniform configuration (no remat, full remat or
`save_matmuls` on every block or every second block) whose measured peak fits the same budget, with the ratio of
our step to its step. All measured in one run, with the same weights and sample per workload; step times are
medians of interleaved repeats. A plan's first training step checks it (NOTE [ The first step ] in
remat/_budget/first_step.py); the measured peak is the next step's, and the summary says how many first steps went over
and were corrected. The summary line counts overshoots (measured over 1.05 x budget), false
refusals, the mean fill (measured / budget) over the plans returned, and the plans slower than the fastest
uniform configuration that fits in every repeat: the repeats are interleaved, so each pairs our step with the
uniform one taken moments apart, and a plan that ties with a uniform one is slower in about half of them, by
the machine's noise, not in all. Column "fullest": the predicted peak, over the budget, of the fullest plan the
offered choices allow within it, whatever its time (`fullest_peak`): a fill below it is the planner preferring a
faster plan; a fill near it that is still low is the choices' granularity (few blocks, few ways to spend bytes).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

import remat
from remat._budget.costs import ModelCost
from tests.models import WORKLOADS, Workload, build, tracked_peak

__all__ = [
    "FRACTIONS", "QUICK", "QUICK_FRACTIONS", "LEGEND", "SweepRow", "format_sweep", "fullest_peak", "short", "sweep",
]

FRACTIONS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
QUICK = ("gpt2", "convnet")
QUICK_FRACTIONS = (0.3, 0.5, 0.8)
OVER = 1.05
_SHORT = {"kept": "K", "save_matmuls": "M", "full": "F", "save_matmuls/2": "H", "save_matmuls/4": "Q"}


LEGEND = ("choices per block: K kept, M save_matmuls, H / Q the matmuls worth most per byte, up to half / a quarter "
          "of save_matmuls' bytes, F full remat, P a policy of your own")


def short(label: str) -> str:
    """A choice's one-letter name in the tables (P: a policy of the user's own)."""
    return _SHORT.get(label, "P")


@dataclass
class SweepRow:
    """One workload at one fraction (or a uniform configuration, `fraction` None)."""

    model: str
    name: str
    fraction: float | None = None
    budget: int | None = None
    peak: int | None = None
    predicted: int | None = None
    least: int | None = None
    first: int | None = None  # the peak of the plan's first step, tracked by the plan itself
    planning: int | None = None  # the peak of `remat.apply` itself
    replanned: bool = False  # whether the first step went over and the next ran a corrected plan
    choices: str = ""
    fullest: int | None = None  # the largest predicted peak of any plan within the budget (`fullest_peak`)
    times: list[float] = field(default_factory=list)

    @property
    def step(self) -> float | None:
        return statistics.median(self.times) if self.times else None


def _copy(base: Workload) -> Workload:
    return Workload(copy.deepcopy(base.model), base.sample, base.loss)


def _time(work: Workload) -> float:
    for p in work.model.parameters():
        p.grad = None
    torch.manual_seed(0)
    start = time.perf_counter()
    torch.autograd.backward(work.step())
    return time.perf_counter() - start


def _uniform(base: Workload) -> list[tuple[str, Workload]]:
    out = [("no remat", _copy(base))]
    for every in (1, 2):
        out.append((f"full, every {every}", _copy(base)))
        remat.apply(out[-1][1].model, every=every)
        out.append((f"save_matmuls, every {every}", _copy(base)))
        remat.apply(out[-1][1].model, every=every, policy=remat.policies.save_matmuls)
    return out


def sweep_one(
    name: str, fractions: Sequence[float], repeats: int, progress: Callable[[str], None]
) -> list[SweepRow]:
    """The rows of one workload: its uniform configurations, then one per fraction."""
    base = build(name)
    rows: list[SweepRow] = []
    running: list[tuple[SweepRow, Workload]] = []
    for label, work in _uniform(base):
        progress(f"{name}: {label}")
        _time(work)  # warm-up
        row = SweepRow(name, label, peak=tracked_peak(work))
        rows.append(row)
        running.append((row, work))
    none = rows[0].peak
    assert none is not None
    for fraction in fractions:
        progress(f"{name}: budget {fraction:.0%}")
        row = SweepRow(name, f"budget {fraction:.0%}", fraction, budget=int(fraction * none))
        rows.append(row)
        work = _copy(base)
        try:
            with remat.track() as planning:
                remat.apply(work.model, budget=row.budget, sample=base.sample, loss=base.loss)
        except remat.BudgetError as e:
            row.least = e.least_bytes
            continue
        row.planning = max((planning.peak(d) for d in planning.devices if d.type != "meta"), default=0)  # real
        plan = remat.plan(work.model).budget
        first_choice = plan.choice if plan is not None else None
        row.peak = tracked_peak(work)  # the first plain step after apply: the promise holds from it
        plan = remat.plan(work.model).budget
        row.first = plan.measured if plan is not None else None
        row.predicted = plan.peak_bytes if plan is not None else None
        row.choices = " ".join(short(plan.choices[c]) for c in plan.choice) if plan is not None else ""
        row.replanned = plan is not None and plan.choice != first_choice
        row.fullest = fullest_peak(plan.cost, int(fraction * none)) if plan is not None else None
        running.append((row, work))
    for _ in range(repeats):
        for row, work in running:
            row.times.append(_time(work))
    return rows


def sweep(
    names: Sequence[str] = tuple(WORKLOADS),
    fractions: Sequence[float] = FRACTIONS,
    repeats: int = 3,
    progress: Callable[[str], None] = lambda message: None,
) -> list[SweepRow]:
    """Every workload in `names` at every fraction."""
    return [row for name in names for row in sweep_one(name, fractions, repeats, progress)]


def fullest_peak(cost: ModelCost, budget: int) -> int | None:
    """The largest predicted peak of any choice per block that fits `budget` under `cost` (NOTE [ Budget model ]
    in remat/_budget/costs.py), whatever its time: how full a plan the offered choices could make.

    The states are (bytes held by the blocks so far, peak so far); only repeats are merged, since a plan that
    holds more may both peak higher and fit less.

    >>> from remat._budget.costs import BlockCost
    >>> kept, full = (BlockCost(8, 10, 10, 1.0, 1.0), BlockCost(2, 10, 10, 1.0, 2.0))
    >>> cost = ModelCost(("0", "1"), ("kept", "full"), ((kept, full), (kept, full)), (0, 0, 0))
    >>> fullest_peak(cost, 20), fullest_peak(cost, 17), fullest_peak(cost, 9)
    (18, 12, None)
    """
    states = {(0, 0)}
    for i, row in enumerate(cost.blocks):
        states = {
            (held + block.held_bytes, max(peak, held + cost.outside_peaks[i], held + block.need))
            for held, peak in states
            for block in row
            if block is not None and max(held + cost.outside_peaks[i], held + block.need) <= budget
        }
    ends = [max(peak, held + cost.outside_peaks[-1]) for held, peak in states]
    return max((end for end in ends if end <= budget), default=None)


def _full_peak(rows: Sequence[SweepRow]) -> int | None:
    return next((r.peak for r in rows if r.name == "full, every 1"), None)


def format_sweep(rows: Sequence[SweepRow]) -> tuple[str, bool]:
    """The sweep as aligned text, and whether it kept the budget's promise (no overshoot, no false refusal)."""
    lines = [f"{'model':<9} {'f':>4} {'budget MiB':>10} {'meas/budget':>11} {'fullest':>7} {'pred/meas':>9} "
             f"{'step ms':>8} {'vs uniform':>10}  fastest uniform that fits"]
    overshoots = false_refusals = 0
    fills: list[float] = []
    fullest: list[float] = []
    slower = 0
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        uniform = [r for r in mine if r.fraction is None]
        full = _full_peak(mine)
        for r in (r for r in mine if r.fraction is not None):
            assert r.budget is not None
            fits = [u for u in uniform if u.peak is not None and u.peak <= r.budget and u.step is not None]
            best = min(fits, key=lambda u: u.step or 0.0) if fits else None
            if r.peak is None:
                false = full is not None and full <= r.budget
                false_refusals += false
                least = "-" if r.least is None else f"{r.least / 2**20:.2f}"
                note = f"BudgetError, least {least} MiB{' (FALSE REFUSAL)' if false else ''}"
                lines.append(f"{model:<9} {r.fraction:>4.1f} {r.budget / 2**20:>10.2f} {note}")
                continue
            fill = r.peak / r.budget
            fills.append(fill)
            most = None if r.fullest is None else r.fullest / r.budget
            if most is not None:
                fullest.append(most)
            overshoots += fill > OVER
            ratio = (r.step or 0.0) / best.step if best is not None and best.step else None
            pairs = list(zip(r.times, best.times, strict=False)) if best is not None else []
            behind = bool(pairs) and all(ours > theirs for ours, theirs in pairs)
            slower += behind
            lines.append(
                f"{model:<9} {r.fraction:>4.1f} {r.budget / 2**20:>10.2f} {fill:>11.3f} "
                f"{'-' if most is None else f'{most:.3f}':>7} "
                f"{(r.predicted or 0) / r.peak:>9.3f} {(r.step or 0.0) * 1e3:>8.1f} "
                f"{'-' if ratio is None else f'{ratio:.2f}' + ('*' if behind else ' '):>10}  "
                f"{'none fits' if best is None else f'{best.name} ({(best.step or 0.0) * 1e3:.1f} ms)'}"
                f"  [{r.choices}]"
            )
    mean = statistics.fmean(fills) if fills else 0.0
    planned = [r for r in rows if r.fraction is not None and r.peak is not None and r.budget]
    over = [r.first / r.budget for r in planned if r.first is not None and r.budget and r.first > r.budget]
    lines.append(
        f"first steps: {len(over)} of {len(planned)} measured over their budget"
        f"{f' (at most {max(over):.3f} x)' if over else ''}, {sum(r.replanned for r in planned)} re-planned before "
        f"the next step, {sum(o > OVER for o in over)} over {OVER:.2f} x budget"
    )
    lines.append(
        f"{len(fills)} plans: {overshoots} over {OVER:.2f} x budget, {false_refusals} false refusals, "
        f"mean measured/budget {mean:.3f} (target 0.95: {'met' if mean >= 0.95 else 'MISSED'}); {slower} slower "
        "than the fastest uniform that fits in every repeat (marked *)"
    )
    if fullest:
        lines.append(
            f"the fullest plans the choices allow (predicted, whatever their time: 'fullest'): mean "
            f"{statistics.fmean(fullest):.3f} of the budget"
        )
    lines.append(LEGEND)
    return "\n".join(lines), overshoots == 0 and false_refusals == 0
