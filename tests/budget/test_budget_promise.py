"""The budget's promise, against real tracked steps: a returned plan's measured peak is at most 1.05 x the budget,
or `BudgetError` names a `least_bytes` that full remat of every block does not beat; never a false refusal."""

from __future__ import annotations

import copy
import dataclasses
import io
from typing import Any

import pytest
import torch

import remat
from benchmarks.cli import main
from remat._budget.costs import ModelCost
from tests.models import Workload, build, tracked_peak

pytestmark = pytest.mark.slow  # budget sweeps checked on real steps: NOTE [ Slow tests ] in tests/conftest.py

pytest.importorskip("transformers")


def _copy(base: Workload) -> Workload:
    return Workload(copy.deepcopy(base.model), base.sample, base.loss)


@pytest.mark.parametrize(
    ("name", "fractions"), [("gpt2", (0.4, 0.43, 0.46, 0.5, 0.7)), ("convnet", (0.55, 0.6, 0.63, 0.66, 0.85))]
)
def test_a_plan_meets_its_budget_in_a_real_step_or_is_refused_rightly(name: str, fractions: tuple[float, ...]) -> None:
    base = build(name)
    none = tracked_peak(_copy(base))
    full = _copy(base)
    remat.apply(full.model)
    floor = tracked_peak(full)  # full remat of every block, measured
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
        first = _train_step(work)  # the plan's check: NOTE [ The first step ]
        measured = tracked_peak(work)  # the next step runs the plan the first one left
        assert measured <= budget * 1.05, f"{name} at {fraction}: measured {measured / budget:.3f} x the budget"
        plan = remat.plan(work.model).budget
        assert plan is not None
        if plan.choice == first.choice:  # the first step fitted: it measured what an outside tracker measures
            assert first.measured == plan.measured == measured
    assert planned >= 2


def _train_step(work: Workload) -> remat.Assignment:
    """The plan's first training step (`_train_step_after`); the plan it ran, as measured."""
    plan = remat.plan(work.model).budget
    # unmeasured, unless its prediction did not fit and a real step checked it before apply returned
    assert plan is not None and (plan.measured is None or plan.peak_bytes > plan.budget)
    ran = _train_step_after(work)
    assert ran.choice == plan.choice and ran.measured is not None
    return ran


def test_a_plan_that_went_over_is_corrected_from_its_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # Make the prediction miss: the profile's kept blocks claim to hold 40% less than they do, so the first plan
    # keeps too many of them, and its first training step measures over the budget.
    from remat._budget import driver as _fit
    from remat._budget import regimes as _regimes

    real = _fit.measured_costs

    def optimistic(*args: Any, **kwargs: Any) -> ModelCost:
        cost = real(*args, **kwargs)
        rows = tuple(
            (dataclasses.replace(row[0], held_bytes=int(row[0].held_bytes * 0.6)), *row[1:]) if row[0] else row
            for row in cost.blocks
        )
        return dataclasses.replace(cost, blocks=rows)

    def unused(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("a plan whose prediction fits is checked on the first training step, not before")

    monkeypatch.setattr(_fit, "measured_costs", optimistic)
    monkeypatch.setattr(_regimes, "measure_step", unused)
    base = build("convnet")
    none = tracked_peak(_copy(base))
    budget = int(0.65 * none)
    work = _copy(base)
    remat.apply(work.model, budget=budget, sample=base.sample, loss=base.loss)
    first = _train_step(work)
    assert first.budget == budget and first.measured is not None and first.measured > budget
    assert tracked_peak(_copy_with(work, first)) == first.measured  # what an outside tracker measures for that plan
    checked = [first]
    while len(checked) < 4 and (plan := _train_step_after(work)).measured != checked[-1].measured:
        checked.append(plan)  # the next step ran a corrected plan, and measured it
    final = remat.plan(work.model).budget
    assert final is not None and final.choice != first.choice  # corrected before the second step
    assert final.measured is not None and final.measured <= budget * 1.05
    assert tracked_peak(work) == final.measured
    assert "measured on one real step: step peak" in str(remat.plan(work.model))


def _train_step_after(work: Workload) -> remat.Assignment:
    """One plain training step, gradients made anew as after `zero_grad()`; the model's plan after it."""
    for p in work.model.parameters():
        p.grad = None
    torch.manual_seed(0)
    torch.autograd.backward(work.step())
    plan = remat.plan(work.model).budget
    assert plan is not None
    return plan


def _copy_with(work: Workload, plan: remat.Assignment) -> Workload:
    """A copy of `work` running `plan`'s choices, its check dropped (so that only the outside tracker counts)."""
    twin = _copy(work)
    hook = next(h for h in twin.model._forward_pre_hooks.values() if hasattr(h, "choices"))
    hook.choices.place(twin.model, plan)
    hook.verification = None
    return twin


def test_the_quick_sweep_prints_its_rows_and_keeps_the_promise() -> None:
    out = io.StringIO()
    assert main(["--model", "budget", "--quick", "--quiet"], stdout=out) == 0
    text = out.getvalue()
    assert "gpt2" in text and "convnet" in text and "0 over 1.05 x budget, 0 false refusals" in text
    assert "first steps: " in text and "re-planned before the next step, 0 over 1.05 x budget" in text


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_budget_holds_with_eager_attention_whose_mask_the_rematerialized_layers_hold(family: str) -> None:
    # NOTE [ Outside inputs ] in remat/_budget/costs.py: the 4-D mask eager attention adds to its scores is saved
    # by no layer kept and held by every layer rematerialized. Unpriced, the first step went to 1.075 x B (Qwen2).
    import transformers

    config, model_class = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                           "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[family]
    torch.manual_seed(0)
    base = model_class(config(hidden_size=128, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=1024, attn_implementation="eager"))
    ids = torch.randint(0, 1024, (1, 1024))
    work = Workload(base, {"input_ids": ids, "labels": ids}, None)
    full = tracked_peak(Workload(remat.apply(copy.deepcopy(base)), work.sample, None))
    budget = int(1.05 * full)
    remat.apply(base, budget=budget, sample=work.sample)
    plan = remat.plan(base).budget
    assert plan is not None and plan.full_remat is not None
    assert plan.full_remat[0] == full  # the mask held: 4 MiB low without it
    assert any(plan.choices[c] != "kept" for c in plan.choice), "remat was not active"
    first = _train_step(work)
    assert first.measured is not None and first.measured <= 1.05 * budget
