"""Module attributes once: a forward that changes its modules' plain Python attributes (`self.calls += 1`) leaves
them as one forward did, although rerun runs that forward again in backward (NOTE [ Attributes during recompute ]
in remat/_engine/guard.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_same_grads, randn
from torch import nn

import remat

RUNS: list[str] = []  # every forward appends here: two entries per step prove the recompute ran


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.calls = 0
        self.last_rows: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        RUNS.append("inner")
        self.calls += 1
        self.last_rows = x.shape[0] + self.calls  # a value that differs if the recompute's were kept
        return self.fc(x).tanh()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.calls = 0
        self.mode = "fresh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        RUNS.append("block")
        self.calls += 1
        self.mode = f"called {self.calls}"
        return self.inner(x).sin() * x


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


VARIANTS: list[Any] = [  # (variant, forwards run in all: baseline 4, ours 4, and 4 more where Python reruns)
    pytest.param(lambda model: remat.apply(model, Block), 12, id="apply"),
    pytest.param(lambda model: remat.apply(model), 12, id="apply-auto"),
    pytest.param(lambda model: remat.remat(lambda x: model(x)), 12, id="function"),
    pytest.param(lambda model: remat.apply(model, Block, strategy="replay"), 8, id="replay"),
]


@pytest.mark.parametrize(("variant", "runs"), VARIANTS)
def test_attributes_change_once_per_forward(variant: Callable[[Any], Any], runs: int) -> None:
    RUNS.clear()
    _, ours = assert_same_grads(Model, (randn(5, 6, requires_grad=True),), variant)
    assert len(RUNS) == runs, "remat was active: rerun ran every forward again, replay ran none"
    for block in ours.target.blocks:
        assert block.calls == 1 and block.mode == "called 1"
        assert block.inner.calls == 1 and block.inner.last_rows == 6


def test_recompute_ran_and_counters_still_count_once() -> None:
    RUNS.clear()
    model = remat.apply(Model().double(), Block)
    model(randn(5, 6, requires_grad=True)).sum().backward()
    assert RUNS.count("block") == 4, "each block ran in forward and again in backward"
    assert [block.calls for block in model.blocks] == [1, 1]
    assert [block.inner.calls for block in model.blocks] == [1, 1]
    model(randn(5, 6, requires_grad=True)).sum().backward()
    assert [block.calls for block in model.blocks] == [2, 2], "the next step counts on from there"


def test_tensor_attributes_and_containers_changed_in_place_are_left_alone() -> None:
    class Keeps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[int] = []
            self.last: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.append(1)  # same list object: not restored (documented)
            self.last = x.detach()
            return x.exp()

    module = remat.remat(Keeps())
    x = randn(3, requires_grad=True)
    module(x).sum().backward()
    assert module.seen == [1, 1], "rerun ran the forward twice; a list changed in place is not put back"
    assert module.last is not None


def test_a_recompute_that_raises_still_puts_attributes_back() -> None:
    state = {"fail": False}

    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if state["fail"]:
                raise RuntimeError("boom")
            return x.exp()

    module = remat.remat(Fails())
    y = module(randn(3, requires_grad=True))
    state["fail"] = True
    with pytest.raises(RuntimeError, match="boom"):
        y.sum().backward()
    assert module.calls == 1
