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
from remat._engine import guard


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


class Renormed(nn.Module):
    """Batch Renormalization's pattern: a correction read from a running statistic without grad, then the
    statistic moved in place, before the output is made or (`update_last`) after it, past recompute's early stop
    (NOTE [ Buffers read before forward changed them ] in remat/_engine/guard.py)."""

    def __init__(self, update_last: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.register_buffer("running", torch.ones(6))
        self.update_last = update_last

    def _update(self, h: torch.Tensor) -> None:
        with torch.no_grad():
            self.running.mul_(0.9).add_(h.std(0), alpha=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        with torch.no_grad():
            r = (h.std(0) / self.running).clamp(0.5, 2.0)
        if not self.update_last:
            self._update(h)
        out = (h * r).tanh()
        if self.update_last:
            self._update(h)
        return out


class Annealed(nn.Module):
    """A step count kept in a buffer, read as a Python number and then counted (`first`: counted, then read)."""

    def __init__(self, first: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.first = first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            self.steps.add_(1)
        scale = 1.0 / (1.0 + float(self.steps))
        if not self.first:
            self.steps.add_(1)
        return (self.fc(x) * scale).tanh()


def _backward_refused(site: Callable[[torch.Tensor], torch.Tensor], match: str) -> None:
    loss = site(randn(5, 6, requires_grad=True)).sum()
    with pytest.raises(remat.RecomputeMismatchError, match=match):  # raised by the recompute
        loss.backward()

    assert guard._local.depth == 0 and not guard._local.reads and not guard._local.open  # nothing left behind


STALE_SITES: list[Any] = [
    pytest.param(lambda: Renormed(), "Renormed.running", id="instance"),
    pytest.param(lambda: Renormed(update_last=True), "Renormed.running", id="changed-after-the-output"),
    pytest.param(lambda: Annealed(), "Annealed.steps.*a Python number", id="read-as-a-number"),
]


@pytest.mark.parametrize(("make", "buffer"), STALE_SITES)
def test_rerun_refuses_a_buffer_read_before_forward_changed_it(make: Callable[[], nn.Module], buffer: str) -> None:
    """docs/design.md, 'Side effects': recompute reads the buffer as forward left it, not as forward read it, so it
    rebuilt other tensors than forward saved and the gradients were silently wrong (0.013 off for `Renormed`, as
    torch.utils.checkpoint's); now rerun says so, naming the buffer and the site."""
    torch.manual_seed(0)
    model = remat.remat(make().double())
    _backward_refused(model, rf"`{type(model).__name__}` in backward read the buffer `{buffer}.*strategy='replay'")


def test_rerun_refuses_a_stale_read_in_a_function_site() -> None:
    """A function site knows no forward writes: recompute sees the read and then the write itself."""
    torch.manual_seed(0)
    model = Renormed().double()
    _backward_refused(remat.remat(lambda x: model(x)), r"read the buffer `Renormed.running`")


def test_a_chains_recomputation_refuses_a_stale_read() -> None:
    torch.manual_seed(0)
    stages = nn.Sequential(Renormed(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    run = remat.chain(stages, segments=2)
    _backward_refused(run, r"stage 0 of the chain \(Renormed\).*`Renormed.running`")


@pytest.mark.parametrize("make", [p.values[0] for p in STALE_SITES], ids=[p.id for p in STALE_SITES])
def test_replay_replays_the_value_forward_read(make: Callable[[], nn.Module]) -> None:
    assert_same_grads(make, (randn(5, 6, requires_grad=True),), lambda model: remat.remat(model, strategy="replay"))


def test_a_buffer_changed_before_it_is_read_reruns_exactly() -> None:
    """Counted, then read: recompute's read comes after its own (dropped) write, and reads what forward read."""
    _, ours = assert_same_grads(lambda: Annealed(first=True), (randn(5, 6, requires_grad=True),))
    assert int(ours.target.steps) == 1


class InstanceNormed(nn.Module):
    """InstanceNorm with running statistics: it hands BatchNorm copies of them (`running_mean.repeat(b)`) that
    autograd saves although training's backward never reads them, then updates them in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.norm = nn.InstanceNorm1d(6, track_running_stats=True, affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.fc(x.transpose(1, 2)).transpose(1, 2)).tanh()


def test_instance_norm_with_running_statistics_is_not_a_stale_read() -> None:
    """NOTE [ Buffers read before forward changed them ], implementation note 2: raised before (found by running
    remat over models with every kind of normalization)."""
    _, ours = assert_same_grads(InstanceNormed, (randn(4, 6, 5, requires_grad=True),))
    assert not torch.equal(ours.target.norm.running_mean, torch.zeros(6, dtype=torch.float64))  # moved, once
