"""No leaks (docs/design.md, 'What remat guarantees' 8): after backward, after `create_graph=True` double backward,
and after the graph is dropped without backward, nothing a site recorded or rebuilt stays alive — for every
strategy, nested sites, early stop on and off, and every policy.

A leak through C++ (hooks → frame → saved variables → hooks) is invisible to `gc`: these tests hold weak
references to the inputs, the parameter and every activation forward made, drop everything, collect, and
check that each reference is dead.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

import remat
from remat import policies

Site = Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]


def _checkpoint(early_stop: bool) -> Site:
    def wrap(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return lambda *args: remat.checkpoint(fn, *args, use_reentrant=False, early_stop=early_stop)

    return wrap


def _region(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(*args: torch.Tensor) -> torch.Tensor:
        with remat.region():
            return fn(*args)

    return run


def _nested(outer: Site, inner: Site) -> Site:
    def wrap(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        wrapped_inner = inner(fn)
        return outer(lambda x, w: wrapped_inner(x.sin(), w).cos())

    return wrap


SITES: dict[str, Site] = {
    "checkpoint, early stop": _checkpoint(True),
    "checkpoint, no early stop": _checkpoint(False),
    "decorator": remat.remat,
    "replay decorator": remat.remat(strategy="replay"),  # type: ignore[dict-item]
    "region": _region,
    "nested rerun": _nested(remat.remat, remat.remat),
    "nested no early stop": _nested(_checkpoint(False), _checkpoint(False)),
    "region in rerun": _nested(remat.remat, _region),
    "rerun in region": _nested(_region, remat.remat),
}


def _body(made: list[weakref.ref[Any]]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Ops that save their inputs (mm, sin), their own output (exp, tanh) and a tagged tensor.

    `made` gets weak references to forward's activations and their storages (a strong reference from the
    function would itself be a cycle through the graph, in torch's checkpoint too).
    """

    def body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = remat.tag((x @ w).tanh(), "h")
        out = (h.sin().exp() @ w).exp()
        if not made:  # forward's activations only (recompute runs this again)
            made.extend(weakref.ref(t) for t in (h, out))
            made.extend(weakref.ref(t.untyped_storage()) for t in (h, out))
        return out

    return body


def _backward_twice(loss: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """The gradient-penalty pattern: a gradient with a graph, then backward through it."""
    grads = torch.autograd.grad(loss, (x, w), create_graph=True)
    sum((g * g).sum() for g in grads).backward()


def _backward_create_graph(loss: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    loss.backward(create_graph=True)
    x.grad = w.grad = None  # the documented way to break the gradient <-> parameter cycle


MODES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = {
    "backward": lambda loss, x, w: loss.backward(),
    "autograd.grad create_graph": _backward_twice,
    "backward create_graph": _backward_create_graph,
    "graph dropped": lambda loss, x, w: None,
}


def _alive_after(site: Site, mode: str, steps: int = 2) -> int:
    """Run `steps` steps of `site(body)` and return how many of their tensors are still alive."""
    refs: list[weakref.ref[Any]] = []
    for step in range(steps):
        made: list[weakref.ref[Any]] = []
        fn = site(_body(made))
        x = torch.randn(4, 6, requires_grad=True)
        w = torch.randn(6, 6, requires_grad=True)
        loss = fn(x, w).sum()
        MODES[mode](loss, x, w)
        refs += [weakref.ref(x), weakref.ref(w), *made]
        del x, w, loss, made, fn
        if step == 0:
            gc.collect()  # a cycle that gc could collect is not the point: one through C++ is
    gc.collect()
    return sum(ref() is not None for ref in refs)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(SITES))
def test_nothing_stays_alive(name: str, mode: str) -> None:
    assert _alive_after(SITES[name], mode) == 0


POLICIES = {
    "save_matmuls": policies.save_matmuls,
    "save_tagged": policies.save_tagged("h"),
    "matmuls or tagged": policies.save_matmuls | policies.save_tagged("h"),
    "callable": lambda op: "tanh" in str(op),
}


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_nothing_stays_alive_with_a_policy(strategy: str, policy: str, mode: str) -> None:
    site = remat.remat(policy=POLICIES[policy], strategy=strategy)  # type: ignore[call-overload]
    assert _alive_after(site, mode) == 0


# -- what lives while the graph is retained ----------------------------------------------------------------
def test_what_a_partial_backward_rebuilt_and_left_is_dropped_when_it_ends() -> None:
    """`autograd.grad` for `x` alone unpacks `a` but not `b`: the rebuilt `b` must not wait for the graph.

    Rerun, whose recompute runs `fn` again, so the rebuilt `b` is seen (replay's are not Python objects of
    `fn`; its stores are the same code, `Frame.unpack`).
    """
    made: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, b = x.sin().exp(), y.cos().exp()  # each exp saves its output, on its own input's path
        made.append(weakref.ref(b))
        return a + b

    x, y = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    out = remat.remat(fn)(x, y).sum()
    torch.autograd.grad(out, [x], retain_graph=True)
    gc.collect()
    assert all(ref() is None for ref in made), "a rebuilt tensor outlived the backward that rebuilt it"
    (gy,) = torch.autograd.grad(out, [y])  # the retained graph still works
    torch.testing.assert_close(gy, -y.detach().sin() * y.detach().cos().exp())


def test_a_good_recompute_keeps_no_attribute_value_of_the_module() -> None:
    """The snapshot of module attributes for mismatch hints is dropped once recompute went well."""
    seen: list[weakref.ref[torch.Tensor]] = []

    class Caches(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.last = x.sin()  # a module that keeps its last activation (a common pattern for inspection)
            seen.append(weakref.ref(self.last))
            return self.last.exp()

    module = remat.remat(Caches())
    loss = module(torch.randn(4, requires_grad=True)).sum()
    loss.backward(retain_graph=True)  # the frame lives on with the graph
    gc.collect()
    assert seen[0]() is None, "forward's value of `last` is held after recompute"
    del loss


@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_a_site_module_with_buffers_dies_with_its_last_reference(strategy: str) -> None:
    """What a site notes of its modules' buffers (NOTE [ Buffers read before forward changed them ] in guard.py) holds
    none of them: the module, its buffers and BatchNorm's die once the caller lets go."""
    model = remat.remat(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)), strategy=strategy)
    model.register_buffer("scale", torch.ones(4))
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    refs = [weakref.ref(model), weakref.ref(model[1]), weakref.ref(model.scale), weakref.ref(model[1].running_mean)]
    del model
    gc.collect()
    assert [ref() is None for ref in refs] == [True] * 4
