"""Tests of `remat.chain` (`remat._chain.chain`): gradients, RNG, budgets, plans, errors."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

from remat._chain.chain import Chain, chain, parse_budget
from remat._core.errors import BudgetError, RematError


def _stack(seed: int = 0, dropout: float = 0.3, width: int = 16, depth: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers.append(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(dropout)))
    return nn.Sequential(*layers).double()


def _grads_match(reference: nn.Module, remat_chain: nn.Module, x: torch.Tensor, seed: int = 1) -> None:
    """One helper: outputs, input gradient and parameter gradients equal plain autograd's."""
    x1 = x.clone().requires_grad_()
    x2 = x.clone().requires_grad_()
    torch.manual_seed(seed)
    y1 = reference(x1)
    (y1 * torch.arange(y1.numel(), dtype=y1.dtype).view_as(y1)).sum().backward()
    after_ref = torch.rand(3)
    torch.manual_seed(seed)
    y2 = remat_chain(x2)
    (y2 * torch.arange(y2.numel(), dtype=y2.dtype).view_as(y2)).sum().backward()
    after_remat = torch.rand(3)
    torch.testing.assert_close(y2, y1)
    torch.testing.assert_close(x2.grad, x1.grad)
    for (name, p1), p2 in zip(reference.named_parameters(), remat_chain.parameters(), strict=True):
        torch.testing.assert_close(p2.grad, p1.grad, msg=name)
    torch.testing.assert_close(after_remat, after_ref)  # the caller's RNG stream is untouched


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.parametrize("fraction", [1.0, 0.6, 0.45, 0.35])
def test_gradients_equal_plain_sequential_with_dropout(fraction: float) -> None:
    reference = _stack()
    x = torch.randn(32, 16, dtype=torch.float64)
    budgeted = chain(copy.deepcopy(reference), budget=fraction, sample=x)
    _grads_match(reference, budgeted, x)
    plan = budgeted.schedule
    assert plan is not None and plan.budget is not None and plan.peak_bytes <= plan.budget


def test_low_budget_recomputes_and_still_matches() -> None:
    reference = _stack(depth=10)
    x = torch.randn(64, 16, dtype=torch.float64)
    probe = chain(copy.deepcopy(reference), budget=1.0, sample=x)
    assert probe.schedule is not None
    from remat._chain.solver import smallest_budget

    least = smallest_budget(probe.schedule.stages, input_bytes=probe.schedule.input_bytes)
    tight = chain(copy.deepcopy(reference), budget=least, sample=x)
    assert tight.schedule is not None and tight.schedule.extra_forwards() > 0
    _grads_match(reference, tight, x)


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_segments_match_plain_sequential(k: int) -> None:
    reference = _stack()
    _grads_match(reference, chain(copy.deepcopy(reference), segments=k), torch.randn(8, 16, dtype=torch.float64))


def test_batchnorm_statistics_move_once_and_state_dict_keys_are_unchanged() -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(
        nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()
    ).double()
    budgeted = chain(copy.deepcopy(reference), budget=0.9)
    assert list(budgeted.state_dict()) == list(reference.state_dict())
    assert isinstance(budgeted, nn.Sequential) and isinstance(budgeted, Chain)
    x = torch.randn(16, 8, dtype=torch.float64)
    _grads_match(reference, budgeted, x)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(budgeted.state_dict()[key], value, msg=key)


def test_callables_and_lists_are_stages() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    reference = nn.Sequential(lin, nn.Tanh(), nn.Linear(4, 4).double())
    budgeted = chain([reference[0], torch.tanh, reference[2]], budget="1MiB")
    assert list(budgeted.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    _grads_match(reference, budgeted, torch.randn(3, 4, dtype=torch.float64))


def test_new_input_shape_reprofiles_and_is_cached() -> None:
    budgeted = chain(_stack(dropout=0.0), budget=0.5)
    assert budgeted.schedule is None
    budgeted(torch.randn(4, 16, dtype=torch.float64, requires_grad=True)).sum().backward()
    first = budgeted.schedule
    budgeted(torch.randn(64, 16, dtype=torch.float64, requires_grad=True)).sum().backward()
    second = budgeted.schedule
    assert first is not None and second is not None and first is not second
    assert second.input_bytes == 64 * 16 * 8
    budgeted(torch.randn(4, 16, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert budgeted.schedule is first


def test_parameters_only_and_no_grad_paths() -> None:
    reference = _stack(dropout=0.0)
    budgeted = chain(copy.deepcopy(reference), budget=0.7)
    x = torch.randn(8, 16, dtype=torch.float64)  # does not require grad
    reference(x).sum().backward()
    budgeted(x).sum().backward()
    for p1, p2 in zip(reference.parameters(), budgeted.parameters(), strict=True):
        torch.testing.assert_close(p2.grad, p1.grad)
    with torch.no_grad():
        torch.testing.assert_close(budgeted(x), reference(x))
    grads = torch.autograd.grad(budgeted(x).sum(), list(budgeted.parameters())[:2])
    assert len(grads) == 2


def test_budget_parsing() -> None:
    assert parse_budget("1.5GiB") == 1610612736
    assert parse_budget("800MB") == 800_000_000
    assert parse_budget("512 kib") == 512 * 1024
    assert parse_budget(1_000) == 1_000
    assert parse_budget(0.25) == 0.25
    for bad in ("1.5 parsecs", "", "-3MB", 0, -1, 1.5, 0.0):
        with pytest.raises(ValueError, match=r"^remat: "):
            parse_budget(bad)
    with pytest.raises(TypeError, match=r"^remat: "):
        parse_budget(True)


def test_budget_below_smallest_raises_budget_error() -> None:
    x = torch.randn(8, 16, dtype=torch.float64)
    with pytest.raises(BudgetError, match=r"^remat: .*smallest feasible budget is \d+ bytes"):
        chain(_stack(), budget=16, sample=x)


def test_argument_errors_at_construction() -> None:
    with pytest.raises(ValueError, match=r"^remat: "):
        chain(_stack())
    with pytest.raises(ValueError, match=r"^remat: "):
        chain(_stack(), budget=0.5, segments=2)
    with pytest.raises(ValueError, match=r"^remat: "):
        chain(_stack(), segments=99)
    with pytest.raises(TypeError, match=r"^remat: "):
        chain([nn.Linear(2, 2), 3], budget=0.5)  # type: ignore[list-item]


def test_tuple_outputs_are_a_clear_type_error() -> None:
    stages: list[nn.Module | Callable[[torch.Tensor], torch.Tensor]]
    stages = [nn.Linear(4, 4), lambda t: (t, t)]  # type: ignore[list-item,return-value]
    with pytest.raises(TypeError, match=r"^remat: chain stages take and return a single tensor"):
        chain(stages, budget=0.5, sample=torch.randn(2, 4))


def test_second_backward_raises() -> None:
    budgeted = chain(_stack(dropout=0.0), budget=0.5)
    y = budgeted(torch.randn(4, 16, dtype=torch.float64, requires_grad=True)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RematError, match=r"^remat: "):
        y.backward()


def test_schedule_renders() -> None:
    budgeted = chain(_stack(), budget=0.5, sample=torch.randn(4, 16, dtype=torch.float64))
    text = str(budgeted.schedule)
    assert text.startswith("remat schedule (optimal): 8 stages")


def test_profiled_time_is_not_one_slow_run() -> None:
    # A stage whose first timed run stalls (a cold kernel, a busy machine) must not be costed at the
    # stall: profiling times each stage in several passes over the chain and keeps the median.
    class Stalls(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 3:  # calls 1 and 2 measure memory (without and with grad); 3 is the first timed run
                time.sleep(0.2)
            out: torch.Tensor = self.linear(x)
            return out

    net = chain([Stalls(), nn.Tanh()], budget=1.0, sample=torch.randn(2, 4))
    assert net.schedule is not None
    assert net.schedule.stages[0].forward_time < 0.1


def _in_place_stages(seed: int = 0) -> nn.Sequential:
    """A convnet's habit: activations in place, each its own stage (NOTE [ A stage that changes its input ])."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Dropout(0.2)]
    return nn.Sequential(*layers).double()


@pytest.mark.parametrize("how", ["segments", "budget"])
def test_a_stage_that_changes_its_input_in_place_runs_on_a_copy(how: str) -> None:
    """Before: torch's "a leaf Variable that requires grad is being used in an in-place operation", naming no stage.
    Now the chain's kept outputs stay what their stages made, and gradients are plain autograd's."""
    reference = _in_place_stages()
    x = torch.randn(32, 16, dtype=torch.float64)
    sample = x.clone()
    options = {"segments": 4} if how == "segments" else {"budget": 0.5}
    built = chain(copy.deepcopy(reference), sample=sample, **options)  # type: ignore[arg-type]
    torch.testing.assert_close(sample, x)  # profiling never changes the caller's sample
    assert built.copies == frozenset({1, 4, 7, 10})
    assert built.schedule is not None and built.schedule.extra_forwards() > 0, "the chain recomputed nothing"
    _grads_match(reference, built, x)


def test_a_stage_that_changes_its_input_only_off_the_sample_is_a_clear_error() -> None:
    """NOTE [ A stage that changes its input ], rule 3: named with the stage and the op, never a silent difference."""

    def sometimes(x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2) if bool(x.sum() > 0) else x * 2

    first = nn.Linear(8, 8).double()
    with torch.no_grad():
        first.weight.abs_()
        first.bias.zero_()  # a positive input makes a positive output, a negative one a negative one
    built = chain([first, sometimes, nn.Linear(8, 8).double()], segments=3)
    built.schedule_for(-torch.ones(4, 8, dtype=torch.float64))  # profiled where the stage does not change its input
    assert built.copies == frozenset()
    with pytest.raises(RematError, match=r"stage 1 of the chain \(_FnStage\) changed its input in place "
                                         r"\(aten\.mul_\.Tensor"):
        built(torch.ones(4, 8, dtype=torch.float64, requires_grad=True))


def test_old_names_of_the_schedule_warn() -> None:
    # `remat.Plan` and `Chain.plan`/`plan_for` were renamed `Schedule`, `schedule`, `schedule_for`: "plan" is
    # `remat.plan`'s table alone. The old names still work, with a DeprecationWarning.
    import remat

    with pytest.warns(DeprecationWarning, match="remat.Schedule"):
        assert remat.Plan is remat.Schedule
    with pytest.warns(DeprecationWarning, match="remat.Schedule"):
        assert remat.remat.Plan is remat.Schedule
    built = chain(_stack(), budget=0.5, sample=torch.randn(4, 16, dtype=torch.float64))
    with pytest.warns(DeprecationWarning, match="Chain.schedule"):
        assert built.plan is built.schedule
    with pytest.warns(DeprecationWarning, match="Chain.schedule_for"):
        assert built.plan_for(torch.randn(4, 16, dtype=torch.float64)) is built.schedule
    assert "Plan" not in remat.__all__
