"""What a rematerialized block holds beyond its own bytes: the inputs made outside the blocks that nothing keeps for
backward when the blocks are kept, an attention mask added to the scores (NOTE [ Outside inputs ] in
remat/_budget/costs.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat._budget.costs import BlockCost, ModelCost, OutsideInput
from remat._budget.solve import evaluate_blocks, solve_budget
from tests.conftest import randn

# -- on paper --------------------------------------------------------------------------------------------------


def test_a_mask_two_rematerialized_blocks_take_is_held_once_from_the_first_of_them() -> None:
    kept, full = BlockCost(10, 10, 20, 1.0, 1.0), BlockCost(1, 10, 20, 1.0, 2.0)
    row = (kept, full)
    mask = OutsideInput(5, frozenset({0, 1, 2}))
    plain = ModelCost(("0", "1", "2"), ("kept", "full"), (row, row, row), (0, 0, 0, 3))
    cost = ModelCost(plain.names, plain.choices, plain.blocks, plain.outside_peaks, outside_inputs=(mask,))
    # every block kept: nothing holds the mask past forward, as the profile saw it
    assert evaluate_blocks(cost, (0, 0, 0)) == evaluate_blocks(plain, (0, 0, 0))
    # blocks 1 and 2 rematerialized hold it once, from block 1's backward on: block 2's backward peaks at
    # S_2 = 10 + 1, plus 20, plus the mask
    assert evaluate_blocks(cost, (0, 1, 1))[0] == evaluate_blocks(plain, (0, 1, 1))[0] + 5 == 36
    # only block 0 rematerialized: the mask lives through every backward, block 0's included, and the loss
    assert evaluate_blocks(cost, (1, 0, 0))[0] == 1 + 10 + 20 + 5
    assert evaluate_blocks(cost, (1, 0, 0))[0] == max(1 + 10 + 10 + 3, 1 + 10 + 20) + 5
    # a block that does not take it holds nothing of it
    other = ModelCost(plain.names, plain.choices, plain.blocks, plain.outside_peaks,
                      outside_inputs=(OutsideInput(5, frozenset({0})),))
    assert evaluate_blocks(other, (0, 1, 1)) == evaluate_blocks(plain, (0, 1, 1))


def test_the_solver_prices_the_mask_where_it_decides() -> None:
    # Rematerializing blocks 1 and 2 fits 37 without the mask (block 2's backward: 10 + 1 + 20); with it, the
    # first rematerialized block must come first, so that nothing before it holds 10: full, full, kept.
    kept, full = BlockCost(10, 10, 20, 1.0, 1.0), BlockCost(1, 10, 20, 1.0, 2.0)
    row = (kept, full)
    mask = OutsideInput(15, frozenset({0, 1, 2}))
    cost = ModelCost(("0", "1", "2"), ("kept", "full"), (row, row, row), (0, 0, 0, 3), outside_inputs=(mask,))
    plain = ModelCost(cost.names, cost.choices, cost.blocks, cost.outside_peaks)
    assert evaluate_blocks(plain, (0, 1, 1))[0] == 31
    assert evaluate_blocks(cost, (0, 1, 1))[0] == 31 + 15  # block 2's backward: 10 + 1 + 20, and the mask
    plan = solve_budget(cost, 37)
    assert plan.choice == (1, 1, 0) and plan.peak_bytes == 37
    assert plan.full_remat is not None and plan.full_remat[0] == 2 + 20 + 15


def test_a_bad_outside_input_is_refused() -> None:
    row = (BlockCost(1, 1, 1, 0.0, 0.0),)
    with pytest.raises(ValueError, match="outside input of a ModelCost of 1 blocks"):
        ModelCost(("0",), ("kept",), (row,), (0, 0), outside_inputs=(OutsideInput(4, frozenset({1})),))


# -- on a model --------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Attention that adds a mask made outside to its scores: autograd saves no input of an addition."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) + mask
        return x + self.out(scores.softmax(-1) @ v)


class Masked(nn.Module):
    """Blocks that all take one causal mask, made in the model's forward as transformers' eager attention makes
    its own."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-2]
        mask = torch.full((n, n), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        for block in self.blocks:
            x = block(x, mask)
        return x


X = randn(1, 128, 8, seed=5)
MASK_BYTES = 128 * 128 * 8


def _step_peak(model: nn.Module) -> int:
    """A training step's tracked peak, from no gradients (what a budget bounds)."""
    for p in model.parameters():
        p.grad = None
    with remat.track() as t:
        model(X).sum().backward()
    return t.peak_bytes


def _model() -> Masked:
    torch.manual_seed(0)
    return Masked().double()


def test_the_profile_notes_the_mask_that_no_kept_block_keeps_and_not_the_input_that_one_does() -> None:
    model = _model()
    remat.apply(model, budget=10**9, sample=X)
    plan = remat.plan(model).budget
    assert plan is not None
    # the mask, taken by every block; not x, which block 0's first linear saves (and the user holds)
    assert plan.cost.outside_inputs == (OutsideInput(MASK_BYTES, frozenset(range(4))),)


def test_full_remats_predicted_step_peak_is_a_real_steps_and_a_budget_between_holds() -> None:
    base = _model()
    full = _step_peak(remat.apply(copy.deepcopy(base), where=Attention))
    kept = _step_peak(copy.deepcopy(base))
    assert full < kept

    model = remat.apply(copy.deepcopy(base), budget=(full + kept) // 2, sample=X)
    plan = remat.plan(model).budget
    assert plan is not None and plan.full_remat is not None
    assert plan.full_remat[0] == full  # without the mask it came out low by MASK_BYTES
    assert any(plan.choices[c] != "kept" for c in plan.choice), "remat was not active"
    measured = _step_peak(model)
    assert measured <= plan.budget
    assert abs(plan.peak_bytes - measured) <= 0.02 * measured


class _Stashing(Attention):
    """Attention that also leaves a tensor the size of its scores in a list the next block's forward empties: the
    profile's derivations do not hold there (NOTE [ Deriving choices ], rule 2), so it runs the choices after its
    kept step."""

    def __init__(self, width: int, shared: list[torch.Tensor]) -> None:
        super().__init__(width)
        self.shared = shared

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.shared.clear()
        self.shared.append(mask.exp())
        return super().forward(x, mask)


def test_a_profile_that_runs_its_choices_after_the_kept_step_keeps_the_kept_steps_mask() -> None:
    # The steps that run the choices rematerialize some block that takes the mask in each, so only the kept step
    # can tell that nothing else holds it.
    shared: list[torch.Tensor] = []
    model = _model()
    model.blocks = nn.ModuleList(_Stashing(8, shared) for _ in range(4)).double()
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        remat.apply(model, budget=10**9, sample=X)
    finally:
        handle.remove()
    assert len(calls) >= 2, "the choices were derived, not run"
    plan = remat.plan(model).budget
    assert plan is not None
    assert plan.cost.outside_inputs == (OutsideInput(MASK_BYTES, frozenset(range(4))),)


# -- outputs no one reads (NOTE [ Outputs no one reads ] in remat/_budget/costs_derived.py) ----------------------


class _Weighing(Attention):
    """Attention that also returns its weights, which the model drops, as transformers' Falcon does with eager
    attention."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = (q @ k.transpose(-1, -2) + mask).softmax(-1)
        return x + self.out(weights @ v), weights


class _Dropping(Masked):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Weighing(8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-2]
        mask = torch.full((n, n), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        for block in self.blocks:
            outputs = block(x, mask)  # the weights live until the next block has returned
            x = outputs[0]
        return x


def test_an_output_the_model_drops_is_not_held_by_a_rematerialized_block() -> None:
    torch.manual_seed(0)
    base = _Dropping().double()
    full = _step_peak(remat.apply(copy.deepcopy(base), where=_Weighing))
    model = remat.apply(copy.deepcopy(base), budget=10**9, sample=X)
    plan = remat.plan(model).budget
    assert plan is not None and plan.full_remat is not None
    # counted held through backward, the weights made full remat come out high by three blocks' worth
    assert plan.full_remat[0] == full
    held = plan.cost.blocks[0][plan.cost.choices.index("full")]
    assert held is not None and held.held_bytes < MASK_BYTES  # the block's output, not its weights
