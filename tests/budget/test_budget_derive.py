"""Full remat and save_matmuls derived from one run kept (NOTE [ Deriving choices ]) against running them."""

from __future__ import annotations

import copy
import gc
import itertools
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_grads, budget_choices, randn, recomputes
from test_budget import Stack, _peak
from torch import nn

import remat
from remat._budget.costs import ModelCost, measured_costs, with_gradients
from remat._budget.profile import accumulation_order, profile_blocks
from remat._budget.solve import evaluate_blocks

LABELS = ("kept", "save_matmuls", "full")


class Residual(nn.Module):
    """A convnet block: two conv + BatchNorm, a residual with a 1x1 projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short: nn.Module = nn.Identity() if stride == 1 and cin == cout else nn.Conv2d(cin, cout, 1, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.short(x))


class ConvNet(nn.Module):
    """Four blocks of four kinds (each kind has one member), between a stem and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = nn.ModuleList([Residual(4, 4, 1), Residual(4, 8, 2), Residual(8, 8, 1), Residual(8, 12, 2)])
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h.mean(dim=(2, 3)))
        return out


class Scaled(nn.Module):
    """Issue 51's block: its first matmul's output is changed in place, which no policy keeps (NOTE [ A kept output
    changed in place ] in remat/_engine/kept.py), so a budget prices it as recomputed."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(width, 4 * width)
        self.b = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.mul_(0.5)
        return x + self.b(h.sin())  # type: ignore[no-any-return]


class Chained(nn.Module):
    """`blocks` one after the other, named `blocks.0`, `blocks.1`, ... (as `_profile` names them)."""

    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)  # type: ignore[no-any-return]


IMAGES = randn(4, 3, 16, 16, seed=1)
TOKENS = randn(4, 32, 16, seed=3)
MODELS: dict[str, tuple[Callable[[], nn.Module], torch.Tensor]] = {
    "convnet": (lambda: ConvNet().double(), IMAGES),
    "transformer": (lambda: Stack().double(), TOKENS),
}


def _profile(model: nn.Module, x: torch.Tensor, derived: tuple[int, ...]) -> ModelCost:
    names = tuple(f"blocks.{i}" for i in range(len(model.blocks)))  # type: ignore[arg-type]
    choices = budget_choices(names, ("kept", remat.policies.save_matmuls, None), LABELS)
    blocks = [model.get_submodule(name) for name in names]
    step = lambda: model(x).sum()  # noqa: E731
    with accumulation_order(model) as order:  # as apply profiles: NOTE [ Gradients in the budget ]
        found = profile_blocks(model, names, blocks, LABELS, step, lambda i, c: choices.assign(model, i, c), order,
                               derived)
    return with_gradients(measured_costs(found), found.gradients)


@pytest.mark.slow  # every choice of every block run for real: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.parametrize("name", sorted(MODELS))
def test_derived_bytes_match_the_bytes_of_running_each_choice(name: str) -> None:
    make, x = MODELS[name]
    torch.manual_seed(0)
    model = make()
    measured, derived = _profile(model, x, ()), _profile(model, x, (1, 2))
    for i in range(len(measured)):
        for c in range(len(LABELS)):
            m, d = measured.blocks[i][c], derived.blocks[i][c]
            assert m is not None and d is not None
            where = f"{name} block {i} {LABELS[c]}"
            assert d.held_bytes == m.held_bytes, where
            # kept's backward bounds rerun's (NOTE [ Deriving choices ]); a few KiB of rerun's own are not in it.
            # With the gradients a block's backward makes counted where they are made, the bound is 1.11 x on
            # the convnet's last block: there the input's gradient sum (16 KiB) comes after the gradients, and
            # kept's autograd still holds two 6 KiB activations that rerun has already dropped.
            assert m.backward_peak * 0.95 <= d.backward_peak <= m.backward_peak * 1.15, where
            assert d.forward_time > 0 and d.backward_time > 0, where
    assert derived.outside_peaks == measured.outside_peaks
    # The step's peak predicted from derived costs, against a real tracked step with those choices put on the
    # blocks: within 5%. Every uniform plan and a spread of mixed ones (all of them would take a while).
    placed = budget_choices(tuple(f"blocks.{i}" for i in range(len(measured))), ("kept", remat.policies.save_matmuls,
                            None), LABELS)
    choices = list(itertools.product(range(len(LABELS)), repeat=len(measured)))
    for choice in choices[:: max(1, len(choices) // 12)] + [(c,) * len(measured) for c in range(len(LABELS))]:
        for i, c in enumerate(choice):
            placed.assign(model, i, c)
        before = recomputes()
        tracked = _peak(model, x)  # a default loop's step: the gradients it makes count
        assert (recomputes() > before) == any(c != 0 for c in choice), choice  # the choices were really on
        assert evaluate_blocks(derived, choice)[0] == pytest.approx(tracked, rel=0.05), (where, choice)
    remat.undo(model)


def _forward_calls(model: nn.Module, run: Callable[[], object]) -> int:
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        run()
    finally:
        handle.remove()
    return len(calls)


def test_blocks_of_distinct_kinds_are_planned_in_one_step() -> None:
    # Four blocks of four kinds: running every choice took three tracked steps; deriving them takes one (the plan
    # is checked on the first training step: NOTE [ The first step ]).
    model = ConvNet().double()
    assert _forward_calls(model, lambda: remat.apply(model, budget=0.85, sample=IMAGES)) == 1
    plan = remat.plan(model).budget
    assert plan is not None and plan.full_remat is not None
    for row in plan.cost.blocks:
        assert all(cost is not None for cost in row[:3])  # the parts are offered where they differ from these


def test_choices_that_cannot_be_derived_still_run() -> None:
    tagged = remat.policies.save_tagged("mid")
    model = ConvNet().double()
    # kept and the user's policy run (two rounds: each kind has one block); save_matmuls and full are derived
    assert _forward_calls(model, lambda: remat.apply(model, budget=0.85, sample=IMAGES, choices=[tagged])) == 2
    replayed = ConvNet().double()
    # replay's recompute is not rerun's: its full remat runs for real (kept, then full)
    assert _forward_calls(replayed, lambda: remat.apply(replayed, budget=0.85, sample=IMAGES, strategy="replay")) == 2


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.parametrize("fraction", [0.7, 0.85])
def test_plans_on_derived_costs_keep_their_budget_and_gradients(fraction: float) -> None:
    torch.manual_seed(0)
    model = ConvNet().double()
    none = _peak(copy.deepcopy(model), IMAGES)
    remat.apply(model, budget=fraction, sample=IMAGES)
    plan = remat.plan(model).budget
    assert plan is not None
    assert any(plan.choices[c] != "kept" for c in plan.choice)
    measured = _peak(model, IMAGES)
    assert measured <= plan.budget * 1.05 and measured < none
    assert plan.peak_bytes == pytest.approx(measured, rel=0.05)
    assert_same_grads(lambda: ConvNet().double(), (IMAGES,), lambda m: remat.apply(m, budget=fraction, sample=IMAGES))


def test_profiling_in_detail_keeps_no_tensor_alive() -> None:
    model = Stack().double()
    outputs: list[weakref.ref[torch.Tensor]] = []
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
    x = TOKENS.clone()
    alive = weakref.ref(x)
    remat.apply(model, budget=0.6, sample=x)
    del x
    gc.collect()
    assert outputs and all(ref() is None for ref in outputs), "a block's output outlived the profile"
    assert alive() is None, "the sample outlived the profile"


class _Stash(nn.Module):
    """A block whose forward leaves a tensor in a shared list, which the next block's forward empties."""

    def __init__(self, shared: list[torch.Tensor], width: int = 16) -> None:
        super().__init__()
        self.shared = shared
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shared.clear()
        h = self.lin(x)
        self.shared.append(h.detach().exp())  # born here, alive after the forward, dead before any backward
        return torch.tanh(h)


def test_blocks_whose_bytes_die_before_their_backward_are_run_not_derived() -> None:
    # NOTE [ Deriving choices ]: the derivations assume a block holds what its forward left alive until its
    # backward; here a quarter of it dies in the next block's forward, so the choices run for real instead.
    shared: list[torch.Tensor] = []
    model = nn.Sequential(*(_Stash(shared) for _ in range(4))).double()
    x = randn(64, 16, seed=4)
    # kept, then all three
    assert _forward_calls(model, lambda: remat.apply(model, budget=0.8, sample=x)) == 2
    shared.clear()
    plan = remat.plan(model).budget
    assert plan is not None
    assert _peak(model, x) <= plan.budget * 1.05


class _Masked(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * (mask[..., :1] > 0)  # autograd saves the comparison, not the mask


class _MaskedStack(nn.Module):
    """Blocks given a mask the model makes in its forward (as Hugging Face models make their attention masks)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Masked() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(*x.shape[:-1], 64, dtype=torch.int64)  # dies once the forward returns
        for block in self.blocks:
            x = block(x, mask)
        return x


def test_a_mask_made_in_the_forward_is_not_kept_alive_by_profiling() -> None:
    # alone.py describes a block's arguments for its run alone; held strongly, the mask lived through the
    # whole profiled step and counted in its backward's bytes: the predicted peak without remat came out high.
    model = _MaskedStack().double()
    x = randn(8, 32, 16, seed=5)
    remat.apply(model, budget=1.0, sample=x)
    plan = remat.plan(model).budget
    assert plan is not None and plan.no_remat is not None
    remat.undo(model)
    assert plan.no_remat[0] == pytest.approx(_peak(model, x), rel=0.01)


def test_derived_bytes_of_a_block_that_changes_a_kept_output_match_running_each_choice() -> None:
    """What `save_matmuls` holds for the block (the changed matmul output dropped when forward ends) is what its
    derivation says."""
    torch.manual_seed(0)
    model = Chained(*(Scaled() for _ in range(4))).double()
    measured, derived = _profile(model, TOKENS, ()), _profile(model, TOKENS, (1, 2))
    for i in range(len(measured)):
        for c in range(len(LABELS)):
            m, d = measured.blocks[i][c], derived.blocks[i][c]
            assert m is not None and d is not None and d.held_bytes == m.held_bytes, (i, LABELS[c])
    kept, matmuls, full = (measured.blocks[0][c].held_bytes for c in range(3))  # type: ignore[union-attr]
    assert full < matmuls < kept


def test_a_matmul_output_changed_in_place_is_priced_as_recomputed() -> None:
    """NOTE [ Deriving choices ]: `save_matmuls` and the parts hold no bytes for a matmul output the block changes in
    place after the call, and a part never picks it; compiled code keeps it (NOTE [ Compiled costs ])."""
    from remat._budget.costs_derived import KeptRun, changed_calls, derive_bytes, part_calls
    from remat._budget.profile_step import Detail

    d = Detail()  # two matmuls (numbers 1 and 2), the output (3); the first matmul's output is changed in place
    d.born, d.matmul, d.calls, d.events = {1: 8, 2: 4, 3: 4}, {1, 2}, {1: 0, 2: 1}, [(1, 8), (2, 4), (3, 4)]
    d.call_time, d.changed = [1.0, 1.0], {1}
    kept = KeptRun(0, 16, 16, 24, 20, 16, frozenset({3}), frozenset({3}), frozenset({3}), d)
    assert changed_calls(d) == {0}
    assert derive_bytes("save_matmuls", kept)[0] == 4 + 4  # the output and the unchanged matmul's
    assert derive_bytes("save_matmuls", kept, compiled=True)[0] == 4 + 8 + 4
    assert part_calls(1.0, d, kept.outputs, changed_calls(d)) == {1}


def test_a_budget_plan_keeps_its_promises_where_a_block_changes_a_kept_output() -> None:
    """Issue 51's six blocks at budget=0.6: the plan keeps matmul outputs in some blocks; before the fix its gradients
    were 0.48 off, and its predicted peak counted the changed outputs as kept. Now: no remat's gradients, the measured
    peak within the budget (+5%) and within 5% of the prediction."""
    x = randn(1024, 128, seed=5)

    def make() -> nn.Module:
        return nn.Sequential(*(Scaled(128) for _ in range(6))).double()

    _, ours = assert_same_grads(make, (x,), lambda m: remat.apply(m, budget=0.6, sample=x))
    plan = remat.plan(ours.target).budget
    assert plan is not None
    assert any(plan.choices[c].startswith("save_matmuls") for c in plan.choice), plan.choices
    measured = _peak(ours.target, x)
    assert measured <= plan.budget * 1.05
    assert plan.peak_bytes == pytest.approx(measured, rel=0.05)


class _SoftmaxDropout(nn.Module):
    """Attention's middle: a softmax whose output autograd saves, read by a dropout that makes a mask and an output
    while it is alive (NOTE [ Deriving choices ], implementation note 1)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        weights = self.drop((h @ h.transpose(-1, -2)).softmax(-1))
        return x + weights @ h


def test_save_matmuls_derived_forward_peak_keeps_an_operand_until_its_last_reader_ran() -> None:
    # Released at the next allocation, the softmax's output died before the dropout had made its mask and output:
    # the derived forward peak came out low by one score tensor of the two the dropout adds.
    torch.manual_seed(0)
    model = Chained(*(_SoftmaxDropout() for _ in range(3))).double()
    x = randn(2, 64, 16, seed=6)
    measured, derived = _profile(model, x, ()), _profile(model, x, (1, 2))
    scores = 2 * 64 * 64 * 8
    for i in range(len(measured)):
        m, d = measured.blocks[i][1], derived.blocks[i][1]
        assert m is not None and d is not None
        assert abs(d.forward_peak - m.forward_peak) < scores // 4, (i, d.forward_peak, m.forward_peak)
    remat.undo(model)
