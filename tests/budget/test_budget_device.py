"""The budget's promises as a device sees them, checked on a device of that size on CPU (`remat.track(limit=...)`,
which raises `torch.OutOfMemoryError` as an allocator does): planning itself, the first step and the steps after
it, with gradients as a default loop's `zero_grad()` leaves them (None) — docs/guides/budget.md."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import recomputes

import remat
from tests.models import Workload, build, tracked_peak

pytestmark = pytest.mark.slow  # four models, AdamW steps under a limit: NOTE [ Slow tests ] in tests/conftest.py

pytest.importorskip("transformers")

MODELS = ("convnet", "bert", "gpt2", "llama")  # the memory flows; budgets on the first two


def _copy(base: Workload) -> Workload:
    return Workload(copy.deepcopy(base.model), base.sample, base.loss)


def _loop(work: Workload, optimizer: torch.optim.Optimizer | None, steps: int = 3) -> None:
    for _ in range(steps):
        if optimizer is not None:
            optimizer.zero_grad()  # set_to_none=True: backward allocates the gradients again
        else:
            work.model.zero_grad()
        work.step().backward()
        if optimizer is not None:
            optimizer.step()


@pytest.mark.parametrize("name", MODELS[:2])
def test_apply_with_a_budget_and_its_steps_fit_a_device_of_the_budget(name: str) -> None:
    base = build(name)
    none = tracked_peak(_copy(base))
    full = _copy(base)
    remat.apply(full.model)
    floor = tracked_peak(full)  # full remat of every block, gradients counted
    budget = int(0.6 * none)
    limit = int(max(budget, floor) * 1.05)
    work = _copy(base)
    with pytest.raises(torch.OutOfMemoryError), remat.track(limit=limit):
        _loop(_copy(base), None, 1)  # the device is too small for a step without remat
    before = recomputes()
    with remat.track(limit=limit) as tracked:  # only what is allocated inside counts: above what was live
        remat.apply(work.model, budget=budget, sample=base.sample, loss=base.loss)
        planning = tracked.peak("cpu")  # the fake twin's storages count on meta, never on the device
        _loop(work, None)
    assert recomputes() > before  # the plan rematerialized something
    assert planning <= limit and tracked.peak("cpu") <= limit


def _total(work: Workload) -> int:
    """The whole loop's peak (parameters, gradients, AdamW's state, activations), the model built inside."""
    with remat.track() as tracked:
        model = copy.deepcopy(work.model)
        _loop(Workload(model, work.sample, work.loss), torch.optim.AdamW(model.parameters()))
    return tracked.peak_bytes


@pytest.mark.parametrize("name", MODELS)
def test_apply_with_memory_and_three_adamw_steps_fit_a_device_of_that_memory(name: str) -> None:
    base = build(name)
    none = _total(base)
    full = _copy(base)
    remat.apply(full.model)
    memory = max(int(0.75 * none), int(1.1 * _total(full)))
    assert memory < none  # the device is too small for the loop without remat
    with pytest.raises(torch.OutOfMemoryError), remat.track(limit=memory):
        _total(base)
    before = recomputes()
    with remat.track(limit=memory) as tracked:  # everything the process makes counts: a device of `memory`
        model = copy.deepcopy(base.model)
        optimizer = torch.optim.AdamW(model.parameters())
        remat.apply(model, memory=memory, sample=base.sample, loss=base.loss, optimizer=optimizer)
        _loop(Workload(model, base.sample, base.loss), optimizer)
    assert recomputes() > before
    assert tracked.peak("cpu") <= memory
