"""Nothing remat does outlives the call that did it (docs/design.md, "What remat keeps process-wide"): the solver
keeps the thread count, a budgeted model's first-step check leaves no optimizer hook, mode or stance between
steps (nor when its forward raises), a tracker leaves `resize_` as it found it, and the first-step check works
under the user's own `remat.track()` (NOTE [ The first step ] in remat/_budget/first_step.py)."""

from __future__ import annotations

import contextlib
import copy
import random
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.optim import optimizer as _optimizer

import remat
from remat._chain import solver
from remat._chain.solver import StageCost
from remat._core.torch_compat import eager_for_now
from tests.conftest import optimistic_profile, randn
from tests.models import Stack

X = randn(4, 32, 16, seed=3)

_TABLES = (
    (_optimizer, "_global_optimizer_pre_hooks"),
    (_optimizer, "_global_optimizer_post_hooks"),
    (_module, "_global_forward_pre_hooks"),
    (_module, "_global_forward_hooks"),
    (_module, "_global_backward_pre_hooks"),
    (_module, "_global_backward_hooks"),
)


def _stance() -> str:
    """Dynamo's stance where dynamo is imported ("default" where it is not)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return "default" if eval_frame is None else str(eval_frame._stance.stance)


def _process() -> dict[str, object]:
    """What a call could leave behind in torch's process-wide state."""
    return {
        "threads": torch.get_num_threads(),
        **{name: tuple(getattr(owner, name)) for owner, name in _TABLES},
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "function modes": torch._C._len_torch_function_stack(),
        "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(False),
        "resize_": torch.UntypedStorage.__dict__.get("resize_"),
        "stance": _stance(),
        "transformers masks": getattr(
            sys.modules.get("transformers.masking_utils"), "find_packed_sequence_indices", None
        ),
    }


@pytest.fixture
def two_threads() -> Iterator[int]:
    """At least two intra-op threads, so that a change to one is seen; the count as it was afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)


def _hook(model: nn.Module) -> Any:
    return next(h for h in model._forward_pre_hooks.values() if hasattr(h, "verification"))


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return Stack(4).double()


def _measured(model: nn.Module) -> int | None:
    plan = remat.plan(model).budget
    assert plan is not None
    return plan.measured


# -- the solver --------------------------------------------------------------------------------------------------


def test_a_solve_keeps_the_thread_count(two_threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = solver._forward_need

    def watched(*args: Any) -> list[list[int]]:  # called inside the dynamic program
        seen.append(torch.get_num_threads())
        return real(*args)

    monkeypatch.setattr(solver, "_forward_need", watched)
    r = random.Random(0)
    stages = [StageCost(r.uniform(1, 3), r.uniform(2, 6), r.randint(10, 50), r.randint(50, 200)) for _ in range(40)]
    budget = sum(s.saved_bytes for s in stages) // 3
    plan = remat.solve(stages, budget, input_bytes=10)
    assert seen and set(seen) == {two_threads}  # the dynamic program ran, and saw the user's thread count
    assert torch.get_num_threads() == two_threads
    assert plan.peak_bytes <= budget < remat.solve(stages, 10**9, input_bytes=10).peak_bytes  # a real schedule


# -- the first-step check ----------------------------------------------------------------------------------------


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_a_budgeted_training_step_leaves_nothing_process_wide() -> None:
    # Whatever ends the first step: the optimizer's step (the loss kept past it, as a loop that logs it keeps
    # it), the death of the step's graph (no optimizer), or `remat.undo`.
    before = _process()
    model = remat.apply(_stack(), budget=0.6, sample=X)
    assert _process() == before
    plan = remat.plan(model).budget
    assert plan is not None and any(plan.choices[c] != "kept" for c in plan.choice)  # remat is on some blocks
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = set(vars(opt)), dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_step_post_hooks)
    for _ in range(2):
        opt.zero_grad()
        loss = model(X).sum()
        loss.backward()
        assert _measured(model) is not None  # the first-step check ran
        opt.step()
        assert _process() == before
        assert (set(vars(opt)), opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks) == optimizer
    del loss
    assert _process() == before
    model = remat.apply(_stack(), budget=0.6, sample=X)
    model(X).sum().backward()  # the loss dies with the statement
    assert _measured(model) is not None and _process() == before
    model = remat.apply(_stack(), budget=0.6, sample=X)
    loss = model(X).sum()
    loss.backward()
    remat.undo(model)
    assert _process() == before


class _Failing(Stack):
    """A stack whose forward raises after its blocks ran, while `fail` is set."""

    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.fail:
            raise ValueError("the user's forward fails")
        return out


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_a_forward_that_raises_leaves_nothing_and_the_next_step_is_checked() -> None:
    before = _process()
    torch.manual_seed(0)
    model = remat.apply(_Failing(4).double(), budget=0.6, sample=X)
    model.fail = True
    with pytest.raises(ValueError, match="the user's forward fails"):
        model(X)
    assert _process() == before
    assert _measured(model) is None and _hook(model).verification is not None  # no step was measured: the check waits
    model.fail = False
    model(X).sum().backward()
    assert _measured(model) is not None
    assert _process() == before


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_overlapping_steps_in_threads_put_the_stance_back() -> None:
    # A budget's profile and a first step under remat's own mode make compiled code run in eager code while they
    # run (dynamo's stance, one for the whole process); from several threads they end in any order.
    import torch._dynamo  # the stance is set only where dynamo is in use

    with contextlib.suppress(ImportError):  # the budget's profile replaces one of its functions while it runs
        import transformers.masking_utils  # noqa: F401

    before = _process()
    first, second = eager_for_now(), eager_for_now()
    assert first is not None and second is not None and _stance() == "force_eager"
    first()
    assert _stance() == "force_eager"  # the second still runs
    second()
    assert _process() == before
    measured: list[int | None] = []

    def train() -> None:
        model = remat.apply(_stack(), budget=0.6, sample=X)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            opt.zero_grad()
            model(X).sum().backward()
            opt.step()
        measured.append(_measured(model))

    threads = [threading.Thread(target=train) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(measured) == 3 and None not in measured  # each thread's first step was checked
    assert _process() == before


# -- the resize_ patch -------------------------------------------------------------------------------------------


def test_a_tracker_leaves_a_patched_resize_as_it_found_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    torchs = torch.UntypedStorage.resize_

    def users(self: torch.UntypedStorage, size: int) -> Any:  # another library's own patch
        calls.append(size)
        return torchs(self, size)

    monkeypatch.setattr(torch.UntypedStorage, "resize_", users)
    x = torch.zeros(8)
    storage = x.untyped_storage()
    with remat.track() as outer:
        with remat.track() as inner:
            storage.resize_(0)
            storage.resize_(64)
        storage.resize_(128)
    assert torch.UntypedStorage.__dict__["resize_"] is users and calls == [0, 64, 128]  # theirs, and still called
    assert inner.peak_bytes == 64 and outer.peak_bytes == 128  # and the trackers still counted the resizes


# -- a user's own tracker around the step ------------------------------------------------------------------------


def _train(model: nn.Module, steps: int, *, tracked: bool) -> tuple[list[tuple[int, ...]], list[str], list[int]]:
    """`steps` plain steps (gradients set to None first), each under the user's `remat.track()` if `tracked`: the
    plan's choices after each step's next forward, the warnings, and the user's tracked peaks."""
    choices: list[tuple[int, ...]] = []
    peaks: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            for p in model.parameters():
                p.grad = None
            if tracked:
                with remat.track() as t:
                    model(X).sum().backward()
                peaks.append(t.peak_bytes)
            else:
                model(X).sum().backward()
            with torch.no_grad():
                model(X)  # the next forward acts on the check (outside training: no step of its own)
            plan = remat.plan(model).budget
            assert plan is not None
            choices.append(plan.choice)
    return choices, [str(w.message) for w in caught], peaks


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_the_first_step_under_the_users_tracker_is_checked_as_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    optimistic_profile(monkeypatch)
    with remat.track() as t:
        _stack()(X).sum().backward()
    budget = int(0.25 * t.peak_bytes)
    plain = remat.apply(_stack(), budget=budget, sample=X)
    first = remat.plan(plain).budget.choice  # type: ignore[union-attr]
    mine = copy.deepcopy(plain)
    unchecked = copy.deepcopy(plain)
    _hook(unchecked).verification = None  # the same plan, never checked
    expected, expected_warnings, _ = _train(plain, 4, tracked=False)
    assert expected[0] != first or expected_warnings  # the check acted on the plan made wrong
    choices, caught, peaks = _train(mine, 4, tracked=True)
    assert (choices, caught) == (expected, expected_warnings)  # under the user's tracker, as without it
    _, _, unchecked_peaks = _train(unchecked, 1, tracked=True)
    assert peaks[0] == unchecked_peaks[0]  # the user's tracker reads what it reads without remat's check
    assert _process()["dispatch modes"] == 0
