"""`remat.apply(budget=..., compile=True)`: a plan for one compiled graph (NOTE [ Compiled as one graph ])."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat._budget.costs import BlockCost, ModelCost
from remat._budget.driver import BudgetHook
from remat._budget.regimes import MemoryRegime
from remat._budget.solve import Assignment, solve_budget
from remat._budget.verify import verify_both_ways
from remat._core.errors import BudgetError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


def _plan(model: nn.Module) -> Assignment:
    hooks = [h for h in model._forward_pre_hooks.values() if isinstance(h, BudgetHook)]
    assert len(hooks) == 1 and hooks[0].assignment is not None
    return hooks[0].assignment


def _compiled_peak_by_kineto(model: nn.Module, x: torch.Tensor) -> int:
    """The outside measurement: torch's public profiler (kineto) over one compiled step, after one that compiles."""
    from torch.profiler import ProfilerActivity, profile

    compiled = torch.compile(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    compiled(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        compiled(x).sum().backward()
    model.zero_grad(set_to_none=True)
    level = peak = 0
    events = prof.profiler.kineto_results.events()  # every allocation, with its signed bytes
    for event in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        level += event.nbytes()
        peak = max(peak, level)
    return peak


@pytest.mark.slow  # budgets compiled as one graph, checked on compiled steps: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's own imports
@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's notes while it traces
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler")
def test_compile_plans_are_checked_on_a_compiled_step() -> None:
    """The plan's measured peak is that of the real compiled step (inductor), read by kineto; gradients equal eager
    code without remat; remat was active (the step peaks below the compiled model without remat)."""
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    plain = nn.Sequential(*[Block() for _ in range(6)]).double().float()
    whole = copy.deepcopy(plain)
    remat.apply(whole, Block, budget=0.7, sample=x, compile=True)
    plan = _plan(whole)
    grads = sum(p.numel() * p.element_size() for p in whole.parameters())
    assert plan.cost.outside_peaks[0] >= grads  # after block 0's backward every gradient is alive
    assert plan.measured is not None and plan.measured <= plan.budget
    assert any(plan.choices[c] != "kept" for c in plan.choice)
    torch._dynamo.reset()
    assert plan.measured == _compiled_peak_by_kineto(whole, x)
    assert plan.measured < _compiled_peak_by_kineto(plain, x)
    got = torch.autograd.grad(torch.compile(whole)(x).sum(), list(whole.parameters()))
    expected = torch.autograd.grad(plain(x).sum(), list(plain.parameters()))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's own imports
@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's notes while it traces
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler")
def test_compiled_bytes_shift_what_fused_code_does_not_allocate() -> None:
    """NOTE [ Compiled bytes ]: compiled code fuses GELU's backward temporaries away, so the backward peak under
    every choice drops (against the same block in eager code, both read from the CPU allocator)."""
    from remat._budget.profile_alone import compiled_shifts, describe_args

    torch._dynamo.reset()
    block = Block()

    def assign(c: int) -> None:  # 0: kept, 1: full remat
        remat.undo(block)
        if c == 1:
            remat(block)

    shifts = compiled_shifts(block, describe_args((torch.randn(256, 64, requires_grad=True),), {}), [0, 1], assign)
    torch._dynamo.reset()
    assert set(shifts) == {0, 1}
    assert all(backward < 0 for _, _, backward in shifts.values()), shifts


@pytest.mark.parametrize(("both_kept", "expected"), [(18, (0, 0)), (24, (1, 0))])
def test_a_prediction_over_the_measured_step_is_taken_both_ways(both_kept: int, expected: tuple[int, int]) -> None:
    """NOTE [ Planned on measured steps ]: where the profile predicts more than compiled steps measure, the faster
    plan the corrected target allows is measured and kept if it fits; one that measures over is not kept."""
    kept, full = BlockCost(8, 12, 16, 1.0, 2.0), BlockCost(1, 12, 20, 1.0, 3.0)
    cost = ModelCost(("0", "1"), ("kept", "full"), ((kept, full), (kept, full)), (0, 0, 4), 0.5)
    plan = solve_budget(cost, 22)  # predicted: full then kept 20 (7.5 s); both kept 24 (6.5 s)
    assert plan.choice == (1, 0)
    measured = {(1, 0): 16, (0, 0): both_kept}  # full then kept measures 4 under its prediction
    on = [plan.choice]
    final = verify_both_ways(plan, lambda a: measured[on[-1]], lambda p: on.append(p.choice))
    assert final.choice == expected and final.measured == measured[expected]
    assert on[-1] == expected  # what is on the blocks is what was kept


def test_nothing_measured_within_the_budget_is_refused_with_the_least() -> None:
    kept, full = BlockCost(8, 12, 16, 1.0, 2.0), BlockCost(1, 12, 20, 1.0, 3.0)
    cost = ModelCost(("0", "1"), ("kept", "full"), ((kept, full), (kept, full)), (0, 0, 4), 0.5)
    plan = solve_budget(cost, 20)  # every choice measures 30: even full remat of both is over the slack
    with pytest.raises(BudgetError, match="measured 30 bytes"):
        verify_both_ways(plan, lambda a: 30, lambda p: None)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's own imports, where this test is the first
@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's notes while it traces
def test_without_allocation_records_compile_plans_on_eager_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch cannot record the CPU allocator's events (`host_bytes` is None), nothing is compiled: the plan
    is checked on an eager step lifted by the gradients a one-graph backward keeps (NOTE [ Compiled as one graph ])."""
    import types

    from remat._budget.profile_alone import compiled_shifts
    from remat._core import torch_compat as _torch_compat
    from remat._measure.step_peak import compiled_peak

    monkeypatch.setattr(_torch_compat, "_autograd", types.SimpleNamespace())
    assert _torch_compat.host_bytes(lambda: None) is None
    model = nn.Sequential(*[Block() for _ in range(4)])
    x = torch.randn(256, 64)
    assert compiled_peak(model, lambda m: m(x).sum()) is None
    assert compiled_shifts(model[0], ((), {}), [0], lambda c: None) == {}
    remat.apply(model, Block, budget=0.6, sample=x, compile=True)
    plan = _plan(model)
    assert plan.measured is not None and plan.measured <= plan.budget * 1.05
    assert any(plan.choices[c] != "kept" for c in plan.choice)


def test_compile_must_be_a_bool_and_go_with_a_budget() -> None:
    model = nn.Sequential(Block(), Block())
    with pytest.raises(TypeError, match="`compile` must be a bool"):
        remat.apply(model, Block, budget=1.0, sample=torch.randn(4, 64), compile="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="go with `budget=`"):
        remat.apply(model, Block, compile=True)
    assert not model[0]._forward_pre_hooks


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_memory_with_compile_checks_a_step_from_no_gradients_once() -> None:
    """With `memory=`, the checked eager step starts without gradients and so already keeps each one as a one-graph
    backward does: `compile=True` must not add them a second time."""
    torch.manual_seed(0)
    x = torch.randn(4, 64)  # few rows: the gradients outweigh the activations, so a one-graph backward adds some
    model = remat.apply(nn.Sequential(*[Block() for _ in range(4)]), Block, memory="64MiB", sample=x,
                        loss=lambda out: out.square().mean(), compile=True)
    hook = next(h for h in model._forward_pre_hooks.values() if isinstance(h, BudgetHook))
    assert isinstance(hook.regime, MemoryRegime) and hook.regime.compiled
    checked = remat.plan(model).budget
    assert checked is not None and checked.measured is not None
    model.zero_grad(set_to_none=True)
    with remat.track() as t:
        torch.autograd.backward(model(x).square().mean())
    assert checked.measured == t.peak_bytes


def _traced_warnings(model: nn.Module, compiled: nn.Module, x: torch.Tensor) -> list[str]:
    import warnings

    from remat._engine import compiled as compiled_module

    compiled_module._warned.discard("budget compiled as one graph")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            compiled(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return [str(w.message) for w in caught if "compiled as one graph" in str(w.message)]


@pytest.mark.slow  # a budget compiled as one graph: NOTE [ Slow tests ] in tests/conftest.py
def test_a_budget_planned_for_eager_code_warns_once_when_compiled_as_one_graph() -> None:
    torch._dynamo.reset()
    x = torch.randn(256, 64)
    eager = remat.apply(nn.Sequential(*[Block() for _ in range(3)]), Block, budget=0.6, sample=x)
    messages = _traced_warnings(eager, torch.compile(eager, backend="eager", fullgraph=True), x)
    assert len(messages) == 1 and "compile=True" in messages[0]  # at trace time only, without a graph break

    torch._dynamo.reset()
    planned = remat.apply(nn.Sequential(*[Block() for _ in range(3)]), Block, budget=0.6, sample=x, compile=True)
    assert _traced_warnings(planned, torch.compile(planned, backend="eager", fullgraph=True), x) == []

    torch._dynamo.reset()
    blockwise = remat.apply(nn.Sequential(*[Block() for _ in range(3)]), Block, budget=0.6, sample=x)
    for block in blockwise:
        block.compile(backend="eager")
    assert _traced_warnings(blockwise, blockwise, x) == []  # each block's backward returns only its own gradients
    torch._dynamo.reset()
