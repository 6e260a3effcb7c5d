"""A budgeted model's first training step verifies its plan (NOTE [ The first step ] in remat/_budget/first_step.py):
measured as an outside tracker measures it, corrected before the next step, and nothing left behind."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_pre_hooks
from torch.utils.flop_counter import FlopCounterMode

import remat
from remat._budget import first_step as _first_step
from remat._core.torch_compat import dispatch_modes_on
from tests.budget.test_budget import _peak  # one step under a tracker around it, gradients there already
from tests.conftest import optimistic_profile, randn
from tests.models import stack

X = randn(4, 32, 16, seed=3)


def _stack() -> nn.Module:
    return stack(4)


def _grads_none_step(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None
    model(X).sum().backward()


def _hook(model: nn.Module) -> Any:
    return next(h for h in model._forward_pre_hooks.values() if hasattr(h, "verification"))


def _no_step_hooks(model: nn.Module) -> bool:
    return not model._forward_hooks and not any(p._post_accumulate_grad_hooks for p in model.parameters())


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_the_first_step_measures_what_a_tracker_around_it_measures() -> None:
    model = remat.apply(_stack(), budget=0.6, sample=X)
    plan = remat.plan(model).budget
    assert plan is not None and plan.measured is None and _hook(model).verification is not None  # not checked yet
    assert "not measured yet: the model's first training step verifies this plan" in str(remat.plan(model))
    assert any(plan.choices[c] != "kept" for c in plan.choice)  # remat is on some blocks
    twin = copy.deepcopy(model)  # the same plan, measured from the outside
    _hook(twin).verification = None
    outside = _peak(twin, X)
    _grads_none_step(model)  # new gradients are made and left out, as the outside step's are
    measured = remat.plan(model).budget.measured  # type: ignore[union-attr]
    assert measured == outside
    assert dispatch_modes_on() == 0 and _no_step_hooks(model)  # the graph died: the mode is popped
    fitted = measured <= plan.budget
    model(X)  # the next forward acts on the check: done if the step fitted, else a corrected plan is placed
    assert (_hook(model).verification is None) == fitted
    if fitted:
        assert remat.plan(model).budget.measured == measured  # type: ignore[union-attr]


def test_an_optimizer_step_pops_the_mode_while_the_loss_lives() -> None:
    model = remat.apply(_stack(), budget=0.6, sample=X)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(X).sum()
    loss.backward()
    assert dispatch_modes_on() == 1  # passes ops through until something pops it
    opt.step()
    assert dispatch_modes_on() == 0 and _no_step_hooks(model)
    assert not any(isinstance(h, _first_step._Hook) for h in _global_optimizer_pre_hooks.values())  # gone with it
    del loss


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_a_step_under_a_users_mode_waits_and_leaves_the_users_mode_alone() -> None:
    # A mode other than the user's `remat.track()` (under which the step rides: tests/test_process_effects.py).
    model = remat.apply(_stack(), budget=0.6, sample=X)
    with FlopCounterMode(display=False) as flops:
        _grads_none_step(model)
        assert dispatch_modes_on() == 1  # the user's own
    assert dispatch_modes_on() == 0 and flops.get_total_flops() > 0
    assert remat.plan(model).budget.measured is None and _hook(model).verification is not None  # type: ignore[union-attr]
    _grads_none_step(model)  # the next plain step checks the plan
    assert remat.plan(model).budget.measured is not None  # type: ignore[union-attr]
    assert dispatch_modes_on() == 0


def test_a_forward_alone_is_not_a_step() -> None:
    model = remat.apply(_stack(), budget=0.6, sample=X)
    model(X)  # its graph dies at once: no step to measure, and nothing left on the stack
    assert dispatch_modes_on() == 0 and _no_step_hooks(model) and _hook(model).verification is not None
    _grads_none_step(model)  # the next training step is tracked
    assert remat.plan(model).budget.measured is not None  # type: ignore[union-attr]


def test_forwards_without_backward_drop_the_check_after_a_window() -> None:
    model = remat.apply(_stack(), budget=0.6, sample=X)
    outs = [model(X) for _ in range(_first_step.WINDOW)]  # graphs kept, never differentiated
    assert _hook(model).verification is not None
    outs.append(model(X))
    assert _hook(model).verification is None and _hook(model).step is None
    assert dispatch_modes_on() == 0 and _no_step_hooks(model)
    del outs


def test_undo_and_a_new_plan_stop_a_tracked_step() -> None:
    model = remat.apply(_stack(), budget=0.6, sample=X)
    out = model(X)
    assert dispatch_modes_on() == 1
    remat.undo(model)
    assert dispatch_modes_on() == 0 and _no_step_hooks(model)
    del out
    again = remat.apply(_stack(), budget=0.6, sample=X)
    out = again(X)
    remat.apply(again, budget=0.7, sample=X)  # replaces the plan and its check
    assert dispatch_modes_on() == 0 and _no_step_hooks(again)
    del out


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_a_model_copied_while_a_step_is_tracked_copies_no_tracking() -> None:
    model = remat.apply(_stack(), budget=0.6, sample=X)
    out = model(X)
    twin = copy.deepcopy(model)
    assert _hook(twin).step is None
    for p in model.parameters():
        p.grad = None
    out.sum().backward()
    del out
    outside = copy.deepcopy(twin)
    _hook(outside).verification = None
    _grads_none_step(twin)  # its copied hooks do nothing; its own first step is tracked
    assert remat.plan(twin).budget.measured == _peak(outside, X)  # type: ignore[union-attr]
    assert dispatch_modes_on() == 0


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_a_tracked_step_keeps_nothing_alive() -> None:
    model = remat.apply(_stack(), budget=0.6, sample=X)
    _grads_none_step(model)
    model(X).sum().backward()  # the second forward acted on the check
    out = model(X)
    grads = torch.autograd.grad(out.sum(), list(model.parameters()), create_graph=True)
    ref = weakref.ref(model)
    del model, out, grads
    gc.collect()
    assert ref() is None


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_when_even_the_least_choice_measures_over_the_step_warns_and_trains_on(monkeypatch: pytest.MonkeyPatch) -> None:
    optimistic_profile(monkeypatch)  # the plan fits on paper, no choice does in a real step
    none = _peak(_stack(), X)
    model = remat.apply(_stack(), budget=int(0.25 * none), sample=X)
    with pytest.warns(UserWarning, match="smallest feasible budget") as caught:
        for _ in range(6):
            _grads_none_step(model)
    assert len(caught) == 1 and "Training goes on with that choice" in str(caught[0].message)
    plan = remat.plan(model).budget
    assert plan is not None and all(plan.choices[c] == "full" for c in plan.choice)
    assert _hook(model).verification is None and dispatch_modes_on() == 0


class _MLP(nn.Module):
    """A block whose `forward` is the test's own code: dynamo skips the frames of torch.nn's modules, so a block
    made of them alone (`nn.Sequential(nn.Linear, ...)`) compiles nothing with `block.compile()`."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))  # type: ignore[no-any-return]


class _Compiled:
    """Four MLP blocks, each compiled by itself with a backend that counts the graphs it is given."""

    def __init__(self) -> None:
        self.graphs: list[int] = []
        torch.manual_seed(0)
        self.model = nn.Sequential(*(_MLP() for _ in range(4)))
        self.model.double()

    def backend(self, gm: torch.fx.GraphModule, inputs: Any) -> Any:
        self.graphs.append(len(gm.graph.nodes))
        return gm.forward

    def compile(self) -> None:
        for block in self.model:
            block.compile(backend=self.backend)

    def step(self, x: torch.Tensor) -> int:
        """One training step from no gradients; how many graphs were compiled so far."""
        for p in self.model.parameters():
            p.grad = None
        self.model(x).sum().backward()
        return len(self.graphs)


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's own notes while it traces
def test_blocks_compiled_one_by_one_still_compile_after_the_tracked_step() -> None:
    # Dynamo runs a frame it meets under a dispatch mode in eager code for good; the tracked step runs compiled
    # code in eager code by a stance instead, so the blocks compile on the step after it.
    torch._dynamo.reset()
    blocks = _Compiled()
    x = randn(64, 16, seed=1)
    remat.apply(blocks.model, budget=0.6, sample=x)
    blocks.compile()
    try:
        assert blocks.step(x) == 0 and remat.plan(blocks.model).budget.measured is not None  # type: ignore[union-attr]
        assert dispatch_modes_on() == 0
        assert blocks.step(x) > 0  # compiled now
    finally:
        torch._dynamo.reset()


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's own notes while it traces
def test_blocks_compiled_before_the_plan_or_a_new_shape_still_compile() -> None:
    # The profile and a re-plan for a new shape run under the tracker too: under the same stance.
    torch._dynamo.reset()
    blocks = _Compiled()
    blocks.compile()
    try:
        x = randn(64, 16, seed=1)
        compiled = blocks.step(x)
        assert compiled > 0
        remat.apply(blocks.model, budget=0.6, sample=x)
        blocks.step(x)  # the plan's first step, tracked, in eager code
        assert blocks.step(x) > compiled  # the blocks' new choices compile
        compiled = len(blocks.graphs)
        bigger = randn(128, 16, seed=2)
        blocks.step(bigger)  # a new shape: re-planned inside this forward, and tracked
        assert blocks.step(bigger) > compiled
    finally:
        torch._dynamo.reset()
