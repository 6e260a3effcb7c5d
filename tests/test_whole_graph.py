"""`remat.apply(budget=..., compile=True)`: a plan for one compiled graph (NOTE [ Compiled as one graph ])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat._fit import _Budget
from remat._plan.budget import BudgetPlan


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


def _plan(model: nn.Module) -> BudgetPlan:
    hooks = [h for h in model._forward_pre_hooks.values() if isinstance(h, _Budget)]
    assert len(hooks) == 1 and hooks[0].budget_plan is not None
    return hooks[0].budget_plan


def test_compile_plans_with_the_gradients_a_graph_keeps() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    eager = remat.apply(nn.Sequential(*[Block() for _ in range(6)]), Block, budget=0.7, sample=x)
    torch.manual_seed(0)
    whole = remat.apply(nn.Sequential(*[Block() for _ in range(6)]), Block, budget=0.7, sample=x, compile=True)
    grads = sum(p.numel() * p.element_size() for p in whole.parameters())
    first, second = _plan(eager), _plan(whole)
    # the compiled prediction counts the gradients of the blocks after block 0 (five of six blocks' worth)
    assert second.peak_bytes <= second.budget and second.budget == first.budget
    assert first.full_remat is not None and second.full_remat is not None
    assert second.full_remat[0] > first.full_remat[0]  # full remat's floor rises by the gradients
    assert second.cost.outside_peaks[0] >= grads  # after block 0's backward every gradient is alive


def test_compile_must_be_a_bool_and_go_with_a_budget() -> None:
    model = nn.Sequential(Block(), Block())
    with pytest.raises(TypeError, match="`compile` must be a bool"):
        remat.apply(model, Block, budget=1.0, sample=torch.randn(4, 64), compile="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="go with `budget=`"):
        remat.apply(model, Block, compile=True)
    assert not model[0]._forward_pre_hooks


def test_memory_with_compile_checks_a_step_from_no_gradients_once() -> None:
    """With `memory=`, the checked eager step starts without gradients and so already keeps each one as a one-graph
    backward does: `compile=True` must not add them a second time."""
    torch.manual_seed(0)
    x = torch.randn(4, 64)  # few rows: the gradients outweigh the activations, so a one-graph backward adds some
    model = remat.apply(nn.Sequential(*[Block() for _ in range(4)]), Block, memory="64MiB", sample=x,
                        loss=lambda out: out.square().mean(), compile=True)
    hook = next(h for h in model._forward_pre_hooks.values() if isinstance(h, _Budget))
    assert hook.compile and hook.grads
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
