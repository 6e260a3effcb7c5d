"""Blocks `remat.apply` places that the model's forward never calls as modules (NOTE [ Blocks that forward never
calls ] in remat/_sites/unreached.py): one warning for a plain apply, an error for a budget's."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from conftest import assert_same_grads, randn, recomputes
from torch import nn

import remat
from remat._sites.unreached import NeverRan


class Quantizer(nn.Module):
    """A layer its model calls through `encode` (as EnCodec's quantizer layers are): no module call."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


class Encoded(nn.Module):
    def __init__(self, through: str = "encode", depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Quantizer() for _ in range(depth))
        self.through = through
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) if self.through == "call" else getattr(layer, self.through)(x)
        return x


class LayerDrop(Encoded):
    """Calls only its last layer on this input (a layer drop that skipped the others)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[-1](x)


def _checks(model: nn.Module) -> list[NeverRan]:
    return [hook for hook in model._forward_hooks.values() if isinstance(hook, NeverRan)]


def _step(model: nn.Module) -> None:
    model(randn(4, 8, requires_grad=True)).sum().backward()


@pytest.mark.parametrize("through", ["encode", "forward"])
def test_warns_once_where_forward_calls_no_block(through: str) -> None:
    model = remat.apply(Encoded(through))
    before = recomputes()
    with pytest.warns(UserWarning, match=r"3 blocks of `Encoded` \(`layers.0`, `layers.1`, `layers.2`\), but its "
                      r"first training forward called none of them as a module.*nothing is rematerialized.*where="):
        _step(model)
    assert recomputes() == before  # what the warning says
    assert not _checks(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model)  # once


def test_blocks_that_run_say_nothing_and_the_check_leaves() -> None:
    assert_same_grads(lambda: Encoded("call"), (randn(4, 8, requires_grad=True),), variant=remat.apply)
    model = remat.apply(Encoded("call"))
    assert len(_checks(model)) == 1
    _step(model)  # pyproject turns warnings into errors
    assert not _checks(model)


def test_a_block_that_ran_is_enough() -> None:
    model = remat.apply(LayerDrop())
    _step(model)
    assert not _checks(model)


class Probed(Encoded):
    """Frozen blocks called as modules under `no_grad`, then a trained head (linear probing)."""

    def __init__(self) -> None:
        super().__init__("call")
        self.head = nn.Linear(8, 8).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = super().forward(x)
        return self.head(x)


def test_blocks_called_under_no_grad_were_called() -> None:
    """The warning said they were called through another method: they were called, with nothing to rebuild."""
    model = remat.apply(Probed(), Quantizer)
    _step(model)  # pyproject turns warnings into errors
    assert not _checks(model)


def test_a_forward_where_sites_would_not_act_leaves_the_check_waiting() -> None:
    model = remat.apply(Encoded())
    with torch.no_grad():
        model(randn(4, 8))
    with remat.enabled(False):
        _step(model)
    assert len(_checks(model)) == 1
    with pytest.warns(UserWarning, match="called none of them"):
        _step(model)


def test_the_check_pickles_copies_undoes_and_is_replaced() -> None:
    model = remat.apply(Encoded())
    remat.apply(model)  # applied again: one check
    assert len(_checks(model)) == 1
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert len(_checks(twin)) == 1
        with pytest.warns(UserWarning, match="called none of them"):
            _step(twin)
    assert len(_checks(model)) == 1  # the copies checked their own blocks
    remat.undo(model)
    assert not _checks(model)
    assert not model._forward_hooks


def test_a_budget_refuses_blocks_its_forward_never_calls() -> None:
    model = Encoded()
    with pytest.raises(ValueError, match=r"profiled a budget's 3 blocks of `Encoded`.*nothing to plan"):
        remat.apply(model, budget=0.5, sample=(randn(4, 8),))
    assert not any(hook for module in model.modules() for hook in module._forward_pre_hooks.values())
    assert not any(hook for module in model.modules() for hook in module._forward_hooks.values())


@remat
class Decorated(Quantizer):
    """Its forward is a site however it is called (`encode` included)."""


def test_sites_that_never_act_or_act_anyhow_are_not_watched() -> None:
    model = Encoded()
    remat.apply(model, enabled=False)
    assert not _checks(model)
    model.layers = nn.ModuleList(Decorated() for _ in range(3)).double()
    remat.undo(model)
    remat.apply(model)
    assert not _checks(model)
    before = recomputes()
    _step(model)
    assert recomputes() == before + 3
