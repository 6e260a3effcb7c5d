"""RNG on every device, proven on a second device type (docs/design.md, 'RNG, autocast and grad mode').

Every site kind runs with dropout on `remat_test`, the device written in Python in tests/pydevice.py (two
indices, each with a random stream of its own, apart from the CPU's): outputs, gradients and the state of every
generator after backward equal a run without remat, and each comparison fails with `preserve_rng=False` (the
control: recompute then draws other masks). Parameters live on index 1 while inputs come on index 0, so the
devices a site must restore are not all among its inputs; a function that reaches them through a closure is the
case torch's checkpoint gets wrong (NOTE [ Which generators a region draws on ] in remat/_engine/rng.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import DeviceRun, assert_same_on_device, randn, run
from torch import nn

import remat
from remat._chain import chain as _chain
from remat._engine import rng as _rng

EQUIVALENCE_HELPERS = ("assert_matches(",)
pytestmark = pytest.mark.usefixtures("test_device")

D0, D1 = "remat_test:0", "remat_test:1"


class Far(nn.Module):
    """Linear, tanh and dropout where the parameters are; the input comes from elsewhere and the output goes back."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        home = self.lin.weight.device
        return F.dropout(self.lin(x.to(home)).tanh(), 0.5, self.training).to(x.device)


def far() -> nn.Module:
    return Far().double().to(D1)


def stack() -> nn.Module:
    return nn.Sequential(Far(), Far(), Far()).double().to(D1)


def closure() -> Callable[[torch.Tensor], torch.Tensor]:
    """A function that reaches a module on index 1 through a closure: no input or site module shows it."""
    module = far()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return module(x.exp()).sin()

    fn.module = module  # type: ignore[attr-defined]  # for the gradients to compare
    return fn


def x0() -> torch.Tensor:
    return randn(4, 8, requires_grad=True).to(D0)


def assert_matches(preserve_rng: bool, make: Callable[[], Any], inputs: tuple[torch.Tensor, ...],
          variant: Callable[[Any], Any]) -> DeviceRun:
    """With `preserve_rng`, the runs are the same and index 1 drew; without it (the control), they differ."""
    if not preserve_rng:
        with pytest.raises(AssertionError, match=r"gradient|output|generator"):
            assert_same_on_device(make, inputs, variant)
        return run(make, inputs, lambda target: target)
    base, _ = assert_same_on_device(make, inputs, variant)
    assert base.drew[2], "nothing was drawn on index 1: the test would not see its stream"
    return base


def as_class(cls: type[nn.Module]) -> Callable[[nn.Module], nn.Module]:
    """The module `make` built, its class switched to the rematerialized subclass `cls`."""

    def variant(module: nn.Module) -> nn.Module:
        module.__class__ = cls
        return module

    return variant


def in_region(preserve_rng: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def variant(target: Callable[..., Any]) -> Callable[..., Any]:
        def call(x: torch.Tensor) -> Any:
            with remat.region(preserve_rng=preserve_rng):
                return target(x)

        return call

    return variant


def _method(preserve_rng: bool) -> Callable[[nn.Module], nn.Module]:
    return as_class(type("FarMethod", (Far,), {"forward": remat.remat(preserve_rng=preserve_rng)(Far.forward)}))


def _class(preserve_rng: bool) -> Callable[[nn.Module], nn.Module]:
    return as_class(remat.remat(preserve_rng=preserve_rng)(type("FarClass", (Far,), {})))


def _sequential(preserve_rng: bool) -> Callable[[nn.Module], Callable[[torch.Tensor], Any]]:
    def variant(model: nn.Module) -> Callable[[torch.Tensor], Any]:
        return functools.partial(remat.checkpoint_sequential, model, 2, use_reentrant=False,
                                 preserve_rng_state=preserve_rng)

    return variant


def _checkpoint(preserve_rng: bool) -> Callable[[Any], Callable[[torch.Tensor], Any]]:
    def variant(target: Any) -> Callable[[torch.Tensor], Any]:
        return functools.partial(remat.checkpoint, target, use_reentrant=False, preserve_rng_state=preserve_rng)

    return variant


# (make, variant for a given preserve_rng): the input comes on index 0, the parameters live on index 1
KINDS: dict[str, tuple[Callable[[], Any], Callable[[bool], Callable[[Any], Any]]]] = {
    "function through a closure": (closure, lambda p: remat.remat(preserve_rng=p)),
    "function, replay": (closure, lambda p: remat.remat(strategy="replay", preserve_rng=p)),
    "function, policy": (closure, lambda p: remat.remat(policy=remat.policies.save_matmuls, preserve_rng=p)),
    "function, policy and replay": (
        closure, lambda p: remat.remat(policy=remat.policies.save_matmuls, strategy="replay", preserve_rng=p)
    ),
    "method": (far, _method),
    "class": (far, _class),
    "instance": (far, lambda p: remat.remat(preserve_rng=p)),
    "apply": (stack, lambda p: lambda m: remat.apply(m, Far, preserve_rng=p)),
    "apply, replay": (stack, lambda p: lambda m: remat.apply(m, Far, strategy="replay", preserve_rng=p)),
    "region": (stack, in_region),
    "checkpoint, module": (far, _checkpoint),
    "checkpoint, closure": (closure, _checkpoint),
    "checkpoint_sequential": (stack, _sequential),
}


@pytest.mark.parametrize("preserve_rng", [True, False], ids=["preserve_rng", "control"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_site_kind_gets_device_masks_back(kind: str, preserve_rng: bool) -> None:
    make, variant = KINDS[kind]
    assert_matches(preserve_rng, make, (x0(),), variant(preserve_rng))


def test_a_closure_reaching_index_1_is_restored() -> None:
    """The case of the issue: inputs on index 0, a module on index 1 reached through a closure (rerun)."""
    base = assert_matches(True, closure, (x0(),), remat.remat)
    assert base.drew == (False, False, True), "only index 1's stream should move"


def test_every_index_of_an_initialised_accelerator_is_stashed() -> None:
    assert _rng.devices_of([randn(2)]) == (torch.device(D0), torch.device(D1))


@pytest.mark.parametrize("preserve_rng", [True, False], ids=["preserve_rng", "control"])
@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_cpu_and_device_dropout_in_one_site(strategy: str, preserve_rng: bool) -> None:
    def make() -> Callable[[torch.Tensor], torch.Tensor]:
        module = far()

        def fn(x: torch.Tensor) -> torch.Tensor:
            return F.dropout(x.sin(), 0.5) * module(x).cos()

        fn.module = module  # type: ignore[attr-defined]
        return fn

    variant = remat.remat(strategy=strategy, preserve_rng=preserve_rng)
    base = assert_matches(preserve_rng, make, (randn(4, 8, requires_grad=True),), variant)
    assert base.drew == (True, False, True)


class Nested(nn.Module):
    """Dropout on index 0, then a site whose module lives on index 1."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Far()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(F.dropout(x.exp(), 0.5)).sin()


@pytest.mark.parametrize("preserve_rng", [True, False], ids=["preserve_rng", "control"])
@pytest.mark.parametrize("inner", ["rerun", "replay"])
@pytest.mark.parametrize("outer", ["rerun", "replay"])
def test_nested_sites_on_two_indices(outer: str, inner: str, preserve_rng: bool) -> None:
    def make() -> nn.Module:
        model = Nested().double().to(D0)
        model.inner.to(D1)
        return model

    def variant(model: nn.Module) -> nn.Module:
        remat.remat(model.inner, strategy=inner, preserve_rng=preserve_rng)
        return remat.remat(model, strategy=outer, preserve_rng=preserve_rng)

    base = assert_matches(preserve_rng, make, (x0(),), variant)
    assert base.drew == (False, True, True)


@pytest.mark.ignores_switch  # remat.chain runs its schedule whatever the switch says
@pytest.mark.parametrize("stashed", [True, False], ids=["devices", "control"])
def test_chain_gets_device_masks_back(stashed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """remat.chain has no `preserve_rng`: the control stashes no device, only the CPU."""
    if not stashed:
        monkeypatch.setattr(_chain, "devices_of", lambda *args, **kwargs: ())
    chains: list[_chain.Chain] = []

    def variant(model: nn.Module) -> nn.Module:
        chains.append(_chain.chain(model, segments=2))
        return chains[-1]

    if stashed:
        base, _ = assert_same_on_device(stack, (x0(),), variant, expect_recompute=False)
        assert base.drew[2]
    else:
        with pytest.raises(AssertionError, match=r"gradient|output|generator"):
            assert_same_on_device(stack, (x0(),), variant, expect_recompute=False)
    plan = chains[-1].schedule
    assert plan is not None and plan.extra_forwards() > 0, "the chain recomputed nothing"
