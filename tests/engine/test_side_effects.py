"""Side effects once (docs/design.md, 'Side effects'): BatchNorm running statistics and `num_batches_tracked`, and
any buffer a forward updates in place, change once per forward whatever the target kind, never again in
recompute."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_same_grads, randn, recomputes
from models import ConvBN
from torch import nn

import remat


class Counting(nn.Module):
    """BatchNorm plus a user buffer updated in place on every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("seen", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        h = self.bn(self.fc(x).tanh())
        self.seen.mul_(0.5).add_(h.detach().mean(0))
        return h.sin()


@remat.remat
class RematCounting(Counting):
    pass


class MethodCounting(Counting):
    @remat.remat
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def _function_calling_the_module(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return remat.remat(lambda x: model(x))


def _checkpoint(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: remat.checkpoint(model, x, use_reentrant=False)


def _reentrant_checkpoint(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: remat.checkpoint(model, x, use_reentrant=True)


def _nested(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    remat.remat(model.bn)
    return remat.remat(lambda x: model(x))


TARGETS: list[Any] = [
    pytest.param(Counting, _function_calling_the_module, id="function-calling-bn"),
    pytest.param(MethodCounting, lambda model: model, id="method"),
    pytest.param(RematCounting, lambda model: model, id="class"),
    pytest.param(Counting, remat.remat, id="instance"),
    pytest.param(Counting, lambda model: remat.apply(model, nn.BatchNorm1d), id="apply"),
    pytest.param(Counting, _checkpoint, id="checkpoint"),
    pytest.param(Counting, _reentrant_checkpoint, id="checkpoint-reentrant"),
    pytest.param(Counting, _nested, id="nested"),
]


@pytest.mark.parametrize(("make", "variant"), TARGETS)
def test_buffers_are_updated_once_per_forward(make: type[nn.Module], variant: Callable[[Any], Any]) -> None:
    base, ours = assert_same_grads(make, (randn(5, 6, requires_grad=True),), variant)
    # the baseline's buffers are compared by the helper; spell out what "once" means too
    assert int(ours.target.calls) == 1 and int(ours.target.bn.num_batches_tracked) == 1
    torch.testing.assert_close(ours.target.bn.running_mean, base.target.bn.running_mean)


def test_buffers_once_when_backward_runs_twice() -> None:
    def twice(loss: torch.Tensor, leaves: list[torch.Tensor]) -> None:
        loss.backward(retain_graph=True)
        loss.backward()

    _, ours = assert_same_grads(Counting, (randn(5, 6, requires_grad=True),), backward=twice)
    assert int(ours.target.calls) == 1 and int(ours.target.bn.num_batches_tracked) == 1


@pytest.mark.equivalence
def test_conv_batchnorm_over_several_steps() -> None:
    """Three training steps: statistics and gradients track the baseline step by step."""
    before = recomputes()
    torch.manual_seed(0)
    plain = ConvBN().double()
    ours = remat.apply(ConvBN().double(), nn.BatchNorm2d)
    ours.load_state_dict(plain.state_dict())
    remat.remat(ours)
    for step in range(3):
        x = randn(2, 3, 5, 5, seed=step)
        plain(x).square().sum().backward()
        ours(x).square().sum().backward()
        for (name, expected), got in zip(plain.state_dict().items(), ours.state_dict().values(), strict=True):
            torch.testing.assert_close(got, expected, msg=f"step {step}: {name}")
    assert int(ours.bn1.num_batches_tracked) == 3
    for (name, p), q in zip(plain.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert recomputes() > before, "remat recomputed nothing"


def test_checkpoint_sequential_updates_batchnorm_once() -> None:
    def make() -> nn.Sequential:
        return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 6), nn.BatchNorm1d(6))

    _, ours = assert_same_grads(
        make, (randn(5, 6, requires_grad=True),),
        lambda seq: lambda x: remat.checkpoint_sequential(seq, 2, x, use_reentrant=False),
    )
    assert [int(m.num_batches_tracked) for m in ours.target if isinstance(m, nn.BatchNorm1d)] == [1, 1]


def test_in_place_ops_on_tensors_made_inside_still_apply_in_recompute() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x * 3.0  # saves nothing, so h may be changed in place
        h.add_(1).mul_(x.detach())  # in place on an activation of the site: must happen in recompute too
        view = h[1:]
        view.sin_()
        return h.sin() * h

    assert_same_grads(lambda: fn, (randn(4, requires_grad=True),))


def test_eval_mode_batchnorm_uses_running_statistics() -> None:
    def make() -> nn.Module:
        model = Counting()
        model.bn.running_mean.fill_(0.3)
        return model.eval()

    _, ours = assert_same_grads(make, (randn(5, 6, requires_grad=True),), remat.remat)
    assert int(ours.target.bn.num_batches_tracked) == 0


class SpectralNormed(nn.Module):
    """A linear layer under spectral norm: its forward runs a step of power iteration on buffers it reads and
    writes in place, then divides the weight by the estimate."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.utils.parametrizations.spectral_norm(nn.Linear(6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).tanh()


@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_spectral_norms_power_iteration_once(strategy: str) -> None:
    """docs/design.md, 'Side effects': recompute's update of the vectors goes to copies, and what it reads after
    the update is forward's result, so the estimate, the gradients and the vectors equal the run without remat."""
    base, ours = assert_same_grads(SpectralNormed, (randn(5, 6, requires_grad=True),),
                                   lambda model: remat.remat(model, strategy=strategy))
    for name, buffer in base.target.named_buffers():
        torch.testing.assert_close(dict(ours.target.named_buffers())[name], buffer)
