"""The budget's promise, against real tracked steps: a returned plan's measured peak is at most 1.05 x the budget,
or `BudgetError` names a `least_bytes` that full remat of every block does not beat; never a false refusal."""

from __future__ import annotations

import copy
import dataclasses
import io
from typing import Any

import pytest

import remat
from remat._measure.costs import ModelCost
from remat.bench.budget_sweep import _peak
from remat.bench.cli import main
from remat.bench.workloads import Workload, build

pytest.importorskip("transformers")


def _copy(base: Workload) -> Workload:
    return Workload(copy.deepcopy(base.model), base.sample, base.loss)


@pytest.mark.parametrize(
    ("name", "fractions"), [("gpt2", (0.3, 0.33, 0.36, 0.4, 0.6)), ("convnet", (0.4, 0.5, 0.58, 0.6, 0.8))]
)
def test_a_plan_meets_its_budget_in_a_real_step_or_is_refused_rightly(name: str, fractions: tuple[float, ...]) -> None:
    base = build(name)
    none = _peak(_copy(base))
    full = _copy(base)
    remat.apply(full.model)
    floor = _peak(full)  # full remat of every block, measured
    assert floor < none
    planned = refused = 0
    for fraction in fractions:
        budget = int(fraction * none)
        work = _copy(base)
        try:
            remat.apply(work.model, budget=budget, sample=base.sample, loss=base.loss)
        except remat.BudgetError as e:
            refused += 1
            assert floor > budget, f"{name} at {fraction}: refused, yet full remat measures {floor} <= {budget}"
            assert e.least_bytes is not None and str(e.least_bytes) in str(e)
            assert budget < e.least_bytes <= floor * 1.05
            continue
        planned += 1
        measured = _peak(work)
        assert measured <= budget * 1.05, f"{name} at {fraction}: measured {measured / budget:.3f} x the budget"
        plan = remat.plan(work.model).budget
        assert plan is not None and plan.measured == measured  # the plan's own check is a real step too
    assert planned >= 2


def test_a_plan_that_went_over_is_corrected_from_the_measured_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # Make the prediction miss: the profile's kept blocks claim to hold 40% less than they do, so the first plan
    # keeps too many of them, and its checked step measures over the budget.
    from remat import _fit

    real = _fit.profile_blocks  # type: ignore[attr-defined]

    def optimistic(*args: Any, **kwargs: Any) -> ModelCost:
        cost = real(*args, **kwargs)
        rows = tuple(
            (dataclasses.replace(row[0], held_bytes=int(row[0].held_bytes * 0.6)), *row[1:]) if row[0] else row
            for row in cost.blocks
        )
        return dataclasses.replace(cost, blocks=rows)

    monkeypatch.setattr(_fit, "profile_blocks", optimistic)
    checked: list[int] = []
    measure = _fit.measure_step  # type: ignore[attr-defined]

    def recorded(*args: Any) -> int:
        checked.append(measure(*args))
        return checked[-1]

    monkeypatch.setattr(_fit, "measure_step", recorded)
    base = build("convnet")
    none = _peak(_copy(base))
    budget = int(0.65 * none)
    work = _copy(base)
    remat.apply(work.model, budget=budget, sample=base.sample, loss=base.loss)
    plan = remat.plan(work.model).budget
    assert plan is not None and plan.budget == budget
    assert len(checked) >= 2 and checked[0] > budget  # the first plan measured over; another one was checked
    assert _peak(work) == plan.measured == checked[-1] <= budget * 1.05
    assert "measured peak of one real step" in str(remat.plan(work.model))


def test_the_quick_sweep_prints_its_rows_and_keeps_the_promise() -> None:
    out = io.StringIO()
    assert main(["--model", "budget", "--quick", "--quiet"], stdout=out) == 0
    text = out.getvalue()
    assert "gpt2" in text and "convnet" in text and "0 over 1.05 x budget, 0 false refusals" in text
