"""The chain's memory model against the tracker: what a plan predicts is what `remat.chain` uses.

See NOTE [ Memory model ] (remat/_chain/simulate.py) and NOTE [ Backward frees as it goes ]
(remat/_chain/stages.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat._chain.chain import chain
from remat._chain.schedule import Schedule
from remat._chain.solver import smallest_budget

BATCH = 8


class MatMul(nn.Module):
    """x @ w with a constant w: no parameter, so the tracker sees activations and gradients only."""

    def __init__(self, cin: int, cout: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("w", torch.randn(cin, cout, generator=g, dtype=torch.float64) / cin**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


class TanhTanh(nn.Module):
    """Two autograd nodes in one stage: its backward frees the output and its gradient halfway."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(x))


def _stages() -> list[nn.Module]:
    # Widths differ so that stages differ in memory; the last stage is a small head, as chains end.
    return [
        MatMul(16, 64, 0), TanhTanh(), Scale(), MatMul(64, 32, 1), nn.Tanh(), MatMul(32, 64, 2), TanhTanh(),
        MatMul(64, 1, 3),
    ]  # fmt: skip


def _measure(net: nn.Module, x0: torch.Tensor) -> int:
    """Tracked peak of one forward and backward; the input is made outside, as the model's x_0 is."""
    x = x0.clone().requires_grad_()
    weights = torch.arange(BATCH, dtype=torch.float64).view(BATCH, 1)  # a loss gradient with real bytes
    with remat.track() as t:
        (net(x) * weights).sum().backward()
    assert x.grad is not None
    return t.peak_bytes


def _budgets(x0: torch.Tensor) -> list[int]:
    probe = chain(_stages(), segments=1, sample=x0)
    assert probe.schedule is not None
    stages, input_bytes = probe.schedule.stages, probe.schedule.input_bytes
    low = smallest_budget(stages, input_bytes=input_bytes)
    high = Schedule.no_remat(stages, input_bytes=input_bytes).peak_bytes
    return [low + (high - low) * k // 4 for k in range(5)]


# The loss's scalar and the seed of each stage's backward (a 0-d tensor) are not in the model, and
# autograd holds the gradient of the chain's output (x_L bytes: BATCH doubles here) until the chain's
# backward returns, which the model releases after the last stage's backward (NOTE [ Memory model ]).
_SLACK = BATCH * 8 + 64


@pytest.mark.parametrize("how", ["segments", "budget"])
def test_predicted_peak_is_the_tracked_peak(how: str) -> None:
    x0 = torch.randn(BATCH, 16, dtype=torch.float64)
    choices = range(1, 9) if how == "segments" else _budgets(x0)
    seen = set()
    for choice in choices:
        net = chain(_stages(), **{how: choice}, sample=x0)  # type: ignore[arg-type]
        plan = net.schedule
        assert plan is not None
        seen.add(plan.ops)
        predicted = plan.peak_bytes - plan.input_bytes
        measured = _measure(net, x0)
        assert predicted <= measured <= predicted + _SLACK, (choice, str(plan), measured)
        if how == "budget":
            assert plan.peak_bytes <= choice
    assert len(seen) >= 3  # several different schedules were checked


def test_backward_frees_the_output_and_its_gradient_as_it_goes() -> None:
    # A wide tanh(tanh(x)) between two narrow stages. Its backward's first node frees the gradient of the
    # output and the output (8 KiB each) before the second allocates the gradient of the input; holding both
    # until the stage's backward returns (torch.autograd.grad(out, inp, grad) from Python does) would add 8 KiB.
    stages: list[nn.Module] = [MatMul(16, 128, 0), TanhTanh(), MatMul(128, 1, 1)]
    x0 = torch.randn(BATCH, 16, dtype=torch.float64)
    net = chain(stages, segments=1, sample=x0)
    assert net.schedule is not None
    tanh = net.schedule.stages[1]
    assert tanh.saved_bytes == 2 * tanh.output_bytes == 2 * BATCH * 128 * 8
    assert tanh.backward_temp <= 16  # the seed and its gradient, two 0-d doubles: nothing the size of x_2
    predicted = net.schedule.peak_bytes - net.schedule.input_bytes
    measured = _measure(net, x0)
    assert predicted <= measured <= predicted + _SLACK


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_with_parameters_the_gap_is_at_most_their_gradients() -> None:
    # Parameter gradients are outside the budget (the chain returns them to autograd when its backward ends):
    # what the tracker sees beyond the plan is at most their bytes.
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()).double() for _ in range(6)]
    gradient_bytes = sum(p.numel() * p.element_size() for s in stages for p in s.parameters())
    x0 = torch.randn(64, 16, dtype=torch.float64)
    weights = torch.arange(16, dtype=torch.float64)  # a loss gradient with real bytes, as in _measure
    for k in (1, 2, 3, 6):
        net = chain(stages, segments=k, sample=x0)
        assert net.schedule is not None
        predicted = net.schedule.peak_bytes - net.schedule.input_bytes
        for p in net.parameters():
            p.grad = None
        x = x0.clone().requires_grad_()
        with remat.track() as t:
            (net(x) * weights).sum().backward()
        assert predicted <= t.peak_bytes <= predicted + gradient_bytes + 64 * 16 * 8, k
