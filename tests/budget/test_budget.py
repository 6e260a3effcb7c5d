"""Tests of `remat.apply(model, budget=..., sample=...)` (docs/guides/budget.md): the solver, the profile, the face."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import remat
from remat._budget.costs import BlockCost, ModelCost, OutsideInput
from remat._budget.solve import evaluate_blocks, least_budget_blocks, solve_blocks, solve_budget
from tests.conftest import assert_same_grads, randn
from tests.models import ConvBN, TransformerBlock

# -- the solver, on paper ------------------------------------------------------------------------------------


@st.composite
def model_costs(draw: st.DrawFn) -> ModelCost:
    """Random small instances: 1-5 blocks, 1-3 choices (some closed; the first is kept), integer sizes and times, and
    0-2 groups of outside inputs (NOTE [ Outside inputs ] in remat/_budget/costs.py)."""
    n, k = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    rows = []
    for _ in range(n):
        row: list[BlockCost | None] = []
        for _ in range(k):
            if row and draw(st.booleans()) and draw(st.booleans()):
                row.append(None)
                continue
            row.append(BlockCost(
                held_bytes=draw(st.integers(0, 12)), forward_peak=draw(st.integers(0, 20)),
                backward_peak=draw(st.integers(0, 20)), forward_time=float(draw(st.integers(0, 6))),
                backward_time=float(draw(st.integers(0, 6))),
            ))
        rows.append(tuple(row))
    outside = tuple(draw(st.integers(0, 15)) for _ in range(n + 1))
    inputs = tuple(
        OutsideInput(draw(st.integers(0, 10)), frozenset(draw(st.sets(st.integers(0, n - 1), min_size=1))))
        for _ in range(draw(st.integers(0, 2)))
    )
    return ModelCost(tuple(map(str, range(n))), ("kept", *(f"c{c}" for c in range(1, k))), tuple(rows), outside, 1.0,
                     outside_inputs=inputs)


def _exhaustive(cost: ModelCost) -> list[tuple[int, float, tuple[int, ...]]]:
    plans = []
    for choice in itertools.product(*(range(len(cost.choices)) for _ in range(len(cost)))):
        if all(cost.blocks[i][c] is not None for i, c in enumerate(choice)):
            peak, time = evaluate_blocks(cost, choice)
            plans.append((peak, time, choice))
    return plans


@settings(max_examples=150, deadline=None)
@given(model_costs(), st.integers(0, 80))
def test_solver_agrees_with_exhaustive_search(cost: ModelCost, budget: int) -> None:
    plans = _exhaustive(cost)
    fits = [time for peak, time, _ in plans if peak <= budget]
    found = solve_blocks(cost, budget)
    if not fits:
        assert found is None
    else:
        assert found is not None
        peak, time = evaluate_blocks(cost, found[0])
        assert peak <= budget
        assert time == pytest.approx(min(fits)) == pytest.approx(found[1])
    least, choice = least_budget_blocks(cost)
    assert least == min(peak for peak, _, _ in plans)
    assert evaluate_blocks(cost, choice)[0] == least


def test_order_matters_not_just_held_bytes() -> None:
    # Two identical blocks: the last one's backward runs first, while the first one still holds its bytes, so
    # keeping the *last* block is what fits; a knapsack on held bytes alone could not tell the two apart.
    kept, full = BlockCost(10, 10, 20, 1.0, 1.0), BlockCost(1, 10, 22, 1.0, 2.0)
    cost = ModelCost(("a", "b"), ("kept", "full"), ((kept, full), (kept, full)), (0, 0, 0), 0.0)
    plan = solve_budget(cost, 23)
    assert [plan.choices[c] for c in plan.choice] == ["full", "kept"]
    assert plan.peak_bytes == evaluate_blocks(cost, (1, 0))[0] == 22


def test_budget_error_names_the_smallest_budget_on_paper() -> None:
    kept, full = BlockCost(10, 10, 20, 1.0, 1.0), BlockCost(1, 10, 22, 1.0, 2.0)
    cost = ModelCost(("a", "b"), ("kept", "full"), ((kept, full), (kept, full)), (0, 0, 5), 0.0)
    least = least_budget_blocks(cost)[0]
    with pytest.raises(remat.BudgetError, match=f"smallest feasible budget is {least} bytes") as info:
        solve_budget(cost, least - 1)
    assert info.value.least_bytes == least
    assert solve_budget(cost, least).peak_bytes <= least


def test_an_extra_choice_that_wins_is_chosen() -> None:
    kept, full, extra = BlockCost(10, 10, 25, 1.0, 1.0), BlockCost(1, 10, 21, 1.0, 3.0), BlockCost(2, 10, 21, 1, 1.5)
    cost = ModelCost(("a",), ("kept", "full", "mine"), ((kept, full, extra),), (0, 0), 0.0)
    plan = solve_budget(cost, 21)
    assert plan.choices[plan.choice[0]] == "mine"


# -- on real models ------------------------------------------------------------------------------------------


class Stack(nn.Module):
    def __init__(self, n: int = 4, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(TransformerBlock(width, 2, dropout=0.1) for _ in range(n))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _stack() -> Stack:
    return Stack().double()


def _peak(model: nn.Module, x: torch.Tensor, *, grads: bool = True) -> int:
    """A step's tracked peak: from no gradients, as `zero_grad()` leaves them, so the new ones count (a budget's
    quantity); or, without `grads`, from zero gradients that backward adds into (a profile's raw costs)."""
    for p in model.parameters():
        p.grad = None if grads else torch.zeros_like(p)
    with remat.track() as t:
        model(x).sum().backward()
    return t.peak_bytes


X = randn(4, 32, 16, seed=3)


@pytest.mark.parametrize("fraction", [0.4, 0.6, 1.0])
def test_gradients_equal_no_remat_under_any_plan(fraction: float) -> None:
    def variant(model: nn.Module) -> nn.Module:
        return remat.apply(model, budget=fraction, sample=X)

    _, ours = assert_same_grads(_stack, (X,), variant, expect_recompute=fraction < 1.0)
    plan = remat.plan(ours.target).budget
    assert plan is not None
    if fraction < 0.5:
        assert any(plan.choices[c] != "kept" for c in plan.choice)


def test_gradients_equal_with_batchnorm_blocks() -> None:
    def make() -> nn.Module:
        return nn.Sequential(*(ConvBN(3 if i == 0 else 4) for i in range(3))).double()

    x = randn(2, 3, 8, 8, seed=1)
    assert_same_grads(make, (x,), lambda m: remat.apply(m, budget=0.8, sample=x))


@pytest.mark.parametrize("fraction", [0.35, 0.7])
def test_peak_stays_within_the_budget(fraction: float) -> None:
    torch.manual_seed(0)
    model = _stack()
    none = _peak(copy.deepcopy(model), X)
    remat.apply(model, budget=fraction, sample=X)
    plan = remat.plan(model).budget
    assert plan is not None
    assert plan.budget == int(fraction * none) or abs(plan.budget - fraction * none) <= 0.05 * none
    measured = _peak(model, X)
    assert measured <= plan.budget * 1.05
    assert measured < none
    assert abs(plan.peak_bytes - measured) <= 0.05 * measured


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_budget_error_names_the_smallest_feasible_budget() -> None:
    model = _stack()
    with pytest.raises(remat.BudgetError, match=r"smallest feasible budget is (\d+) bytes") as info:
        remat.apply(model, budget=1000, sample=X)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules()), "hooks left behind"
    least = info.value.least_bytes
    assert least is not None and str(least) in str(info.value)
    remat.apply(model, budget=least, sample=X)
    assert _peak(model, X) <= least * 1.05


@pytest.mark.parametrize("headroom", [0.25, "4KiB"])
def test_memory_set_to_the_least_a_refusal_names_is_not_refused_for_its_headroom(headroom: float | str) -> None:
    """NOTE [ Total memory ], rule 4: the least total named the peak plus the headroom of the memory given (10% of
    it by default on a caching device), which a larger memory's headroom outgrew: each retry was refused again."""
    with pytest.raises(remat.BudgetError) as info:
        remat.apply(_stack(), memory=1 << 16, headroom=headroom, sample=X, optimizer="sgd")
    least = info.value.least_bytes
    assert least is not None
    with pytest.raises(remat.BudgetError):  # a byte less is short
        remat.apply(_stack(), memory=least - 1, headroom=headroom, sample=X, optimizer="sgd")
    remat.apply(_stack(), memory=least, headroom=headroom, sample=X, optimizer="sgd")


def test_budget_strings_and_bad_arguments() -> None:
    model = _stack()
    remat.apply(model, budget="64MiB", sample=X)
    plan = remat.plan(model).budget
    assert plan is not None and plan.budget == 64 * 2**20
    assert plan.peak_bytes <= plan.budget and plan.no_remat is not None and plan.no_remat[0] <= plan.budget
    with pytest.raises(ValueError, match="needs `sample=`"):
        remat.apply(_stack(), budget=0.5)
    with pytest.raises(ValueError, match="leave out `every`"):
        remat.apply(_stack(), budget=0.5, sample=X, every=2)
    with pytest.raises(ValueError, match="go with `budget=`"):
        remat.apply(_stack(), sample=X)
    with pytest.raises(ValueError, match="cannot read the budget"):
        remat.apply(_stack(), budget="lots", sample=X)
    with pytest.raises(TypeError, match="must return a scalar"):
        remat.apply(_stack(), budget=0.5, sample=X, loss=lambda out: out)


def test_choices_are_honoured() -> None:
    tagged = remat.policies.save_tagged("mid")
    model = _stack()
    remat.apply(model, budget=0.5, sample=X, choices=[tagged])
    plan = remat.plan(model).budget
    assert plan is not None
    # then the choices that keep some matmuls, made per block (NOTE [ Some matmuls ])
    assert plan.choices == ("kept", "save_matmuls", "full", repr(tagged), "save_matmuls/4", "save_matmuls/2")
    assert all(plan.cost.blocks[i][3] is not None for i in range(len(plan.cost)))
    # The chosen options are the ones on the blocks: `remat.plan` lists each site with its policy.
    sites = {site.name: site.choice for site in remat.plan(model)}
    matmuls = repr(remat.policies.save_matmuls)
    shown = {"kept": None, "full": "full", "save_matmuls": matmuls, repr(tagged): repr(tagged)}
    for i, c in enumerate(plan.choice):
        if plan.choices[c].startswith("save_matmuls/"):
            assert str(sites.get(plan.cost.names[i])).startswith(f"{matmuls}[calls ")
        else:
            assert sites.get(plan.cost.names[i]) == shown[plan.choices[c]]
    # And a block given the extra choice runs under it: its gradients still equal no remat.
    hook = next(h for h in model._forward_pre_hooks.values() if hasattr(h, "assignment"))
    for i in range(len(plan.cost)):
        hook.choices.assign(model, i, 3)
    assert all(site.choice == repr(tagged) for site in remat.plan(model))


def test_plan_table_shows_blocks_and_baselines() -> None:
    model = remat.apply(_stack(), budget=0.5, sample=X)
    text = str(remat.plan(model))
    assert "4 blocks under a budget" in text
    assert "blocks.3" in text and "held for backward" in text and "extra time" in text
    assert "predicted step peak" in text and "no remat: step peak" in text and "full remat: step peak" in text
    assert "step peak: the most bytes live during forward and backward" in text  # the table says what it shows


def test_a_plan_made_on_fake_tensors_prints_times_relative_to_no_remat() -> None:
    """Planned on a fake twin, op times are priced on a nominal device: not this device's milliseconds (on an H200
    they read 2.2x the real step), so the plan says how much slower than no remat each choice and the step are."""
    model = remat.apply(_stack(), budget=0.5, sample=X)
    plan = remat.plan(model).budget
    assert plan is not None and plan.cost.priced and plan.no_remat is not None
    text = str(remat.plan(model))
    assert " ms" not in text, text
    assert "no remat: step peak" in text and "step time 1.00x no remat's" in text
    assert f"step time {plan.step_time / plan.no_remat[1]:.2f}x no remat's" in text
    assert "ops priced on a nominal device" in text
    extra = [line.split()[-1] for line in text.splitlines() if line.startswith("blocks.")]
    assert extra and all(cell.endswith("%") for cell in extra), text


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_undo_restores_the_model() -> None:
    model = _stack()
    keys = list(model.state_dict())
    remat.apply(model, budget=0.4, sample=X)
    assert any(m._forward_pre_hooks for m in model.modules())
    remat.undo(model)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert len(remat.plan(model)) == 0 and remat.plan(model).budget is None
    assert list(model.state_dict()) == keys
    assert_same_grads(
        _stack, (X,), lambda m: remat.undo(remat.apply(m, budget=0.4, sample=X)), expect_recompute=False
    )


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_plan_survives_deepcopy_and_state_dict() -> None:
    model = _stack()
    keys = list(model.state_dict())
    remat.apply(model, budget=0.4, sample=X)
    assert list(model.state_dict()) == keys
    twin = copy.deepcopy(model)
    assert str(remat.plan(twin)) == str(remat.plan(model))
    twin.load_state_dict(model.state_dict())
    assert [s.name for s in remat.plan(twin)] == [s.name for s in remat.plan(model)]
    # The copy's hooks act on the copy's blocks: its peak follows the plan, and no re-plan happens.
    before = remat.plan(twin).budget
    assert before is not None
    assert _peak(twin, X) <= before.budget * 1.05
    assert remat.plan(twin).budget.cost is before.cost  # type: ignore[union-attr]
    torch.manual_seed(0)
    reference = _stack()
    copied = copy.deepcopy(remat.apply(copy.deepcopy(reference), budget=0.4, sample=X))
    for net in (reference, copied):
        torch.manual_seed(1)
        net(X).sum().backward()
    for (name, p), q in zip(reference.named_parameters(), copied.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_a_new_input_shape_replans() -> None:
    model = remat.apply(_stack(), budget=0.4, sample=X)
    first = remat.plan(model).budget
    model(randn(4, 32, 16, seed=5)).sum().backward()  # same shape: same plan (its first step measured it)
    assert first is not None and remat.plan(model).budget.cost is first.cost  # type: ignore[union-attr]
    bigger = randn(8, 32, 16, seed=6)
    model(bigger).sum().backward()
    second = remat.plan(model).budget
    assert second is not first and second is not None and first is not None
    assert second.budget > first.budget  # a fraction of the new shape's peak
    with torch.no_grad():
        model(randn(2, 32, 16))  # no gradients: no re-plan
    assert remat.plan(model).budget.cost is second.cost  # type: ignore[union-attr]


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_replan_false_keeps_the_plan() -> None:
    model = remat.apply(_stack(), budget=0.4, sample=X, replan=False)
    first = remat.plan(model).budget
    model(randn(8, 32, 16, seed=6)).sum().backward()
    assert first is not None and remat.plan(model).budget.cost is first.cost  # type: ignore[union-attr]


def test_profiling_leaves_rng_grads_and_buffers_alone() -> None:
    model = nn.Sequential(*(ConvBN(3 if i == 0 else 4) for i in range(3))).double()
    x = randn(2, 3, 8, 8, seed=1)
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    state = torch.get_rng_state()
    remat.apply(model, budget=0.8, sample=x)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(bool((p.grad == 7.0).all()) for p in model.parameters() if p.grad is not None)
    for k, v in model.named_buffers():
        torch.testing.assert_close(v, buffers[k])


def test_planning_identical_blocks_runs_the_model_once_and_times_every_block() -> None:
    # NOTE [ Timing under the tracker ]: on CPU one tracked step gives bytes and times; a stack of 4 identical
    # blocks with 3 choices needs one round, so the model runs forward exactly once while planning (the plan is
    # checked on the first training step: NOTE [ The first step ]).
    model = _stack()
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    remat.apply(model, budget=0.6, sample=X)
    assert len(calls) == 1
    plan = remat.plan(model).budget
    assert plan is not None
    for row in plan.cost.blocks:
        for cost in row:
            assert cost is not None and cost.forward_time > 0 and cost.backward_time > 0


def test_a_block_is_timed_alone_on_fresh_inputs_shaped_like_its_own() -> None:
    from remat._budget.profile_alone import describe_args, time_alone

    seen: list[tuple[torch.Tensor, torch.Tensor, str]] = []

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor, *, mask: torch.Tensor, tag: str) -> torch.Tensor:
            seen.append((x, mask, tag))
            return self.lin(x).masked_fill(mask, 0.0)

    x, mask = randn(2, 16, seed=1).requires_grad_(), torch.tensor([[True], [False]])
    spec = describe_args((x,), {"mask": mask, "tag": "t"})
    fwd, bwd = time_alone(Masked().double(), spec, [])
    assert fwd > 0 and bwd > 0
    fresh, same_mask, tag = seen[0]
    assert fresh is not x and fresh.shape == x.shape and fresh.dtype == x.dtype and fresh.requires_grad
    assert same_mask is mask and tag == "t"


class _Picky(nn.Module):
    """A block that refuses inputs other than the ones the model gives it (negative values)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x > 0).any()):
            raise ValueError("this block only takes the model's own inputs")
        return -torch.relu(self.lin(x)) - 1


def test_a_block_that_cannot_run_alone_is_still_planned() -> None:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*(_Picky() for _ in range(3))).double()

    x = -randn(4, 16, seed=2).abs() - 1
    _, ours = assert_same_grads(
        make, (x,), lambda m: remat.apply(m, budget=1.0, sample=x), expect_recompute=False
    )
    plan = remat.plan(ours.target).budget
    assert plan is not None and plan.peak_bytes <= plan.budget


def test_a_budget_on_a_meta_model_is_refused_when_applied() -> None:
    # A meta model has no bytes to count: a plan made on it would keep every block, silently.
    with torch.device("meta"):
        model = nn.Sequential(*(TransformerBlock(16) for _ in range(3)))
    with pytest.raises(ValueError, match=r"`0\.\S+` is on the meta device.*remat\.estimate"):
        remat.apply(model, budget=0.5, sample=torch.randn(2, 8, 16))
    assert "no rematerialized sites" in str(remat.plan(model))  # nothing was left on the blocks
