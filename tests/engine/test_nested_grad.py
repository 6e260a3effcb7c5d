"""Gradients taken inside a rematerialized function, and sites nested in sites, for every way to make a site.

The scenarios are those of PyTorch's own tests of nested non-reentrant checkpoints (a function that runs
`autograd.grad` or `.backward()` itself, with and without `create_graph=True`; a checkpoint inside a checkpoint,
two and three deep; the outer backward taking first, second and third derivatives), written anew and run under
`remat.checkpoint`, `@remat` with both strategies, and `remat.region()`. Each one compares with the same code run
without remat (float64, `assert_close`), checks that something was recomputed (so it fails with `REMAT=0`), and
checks that the graph it made dies with its last reference (a cycle through C++ would keep it).
"""

from __future__ import annotations

import collections
import gc
import itertools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from conftest import randn

import remat
from remat import policies
from remat._engine import stats as _stats

# `.backward(create_graph=True)` into a non-leaf: the warning is about parameters' `.grad`, which none here is.
pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")

# The comparison every scenario goes through (see NOTE [ Equivalence tests must fail without remat ] in conftest.py).
EQUIVALENCE_HELPERS = ("_compare(",)

Fn = Callable[..., Any]
Site = Callable[[Fn], Fn]


def _checkpoint(early_stop: bool) -> Site:
    def site(fn: Fn) -> Fn:
        return lambda *args, **kwargs: remat.checkpoint(fn, *args, use_reentrant=False, early_stop=early_stop, **kwargs)

    return site


def _block(fn: Fn) -> Fn:
    """`with remat.region():` around the call."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with remat.region():
            return fn(*args, **kwargs)

    return run


SITES: dict[str, Site] = {
    "checkpoint": _checkpoint(True),
    "checkpoint, no early stop": _checkpoint(False),
    "@remat": lambda fn: remat.remat(fn),
    "@remat replay": lambda fn: remat.remat(fn, strategy="replay"),
    "@remat.region()": lambda fn: remat.region()(fn),
    "with remat.region()": _block,
}
NESTING = ["checkpoint", "@remat", "@remat replay", "with remat.region()"]


@contextmanager
def recomputed() -> Iterator[None]:
    """Fail unless remat rebuilt something inside the block (with remat off, nothing is)."""
    before = _stats.recomputes
    yield
    assert _stats.recomputes > before, "nothing was recomputed: remat was not active"


def grad(fn: Fn) -> Fn:
    """The derivative of a scalar function, itself differentiable."""

    def derivative(x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            (gx,) = torch.autograd.grad(fn(x), x, create_graph=True)
        return gx

    return derivative


def total(fn: Fn) -> Fn:
    return lambda x: fn(x).sum()


def graph_dies(fn: Fn) -> None:
    """Call `fn` on a fresh input, tag every node of the graph it returns, drop it: every tag must die."""

    class Tag:
        pass

    def run() -> list[weakref.ref[Tag]]:
        out = fn(randn(requires_grad=True, seed=3))
        tags, seen, queue = [], set(), collections.deque([out.grad_fn])
        while queue:
            node = queue.popleft()
            if node is None or node in seen:
                continue
            seen.add(node)
            tag = Tag()
            node.metadata["tag"] = tag
            tags.append(weakref.ref(tag))
            queue.extend(next_node for next_node, _ in node.next_functions)
        return tags

    tags = run()
    assert [ref for ref in tags if ref() is not None] == [], "part of the graph outlived its last reference"


# -- the functions: plain, and ones that run backward themselves ---------------------------------------------
def plain(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp().sin()


def grads_without_graph(x: torch.Tensor) -> torch.Tensor:
    """Two backwards inside that keep no graph; the result does not depend on them."""
    first = x.sin().exp().sin()
    second = x.cos().exp().sin()
    torch.autograd.grad(first, x)
    torch.autograd.grad(second, x)
    return x.sin()


def grad_with_graph(x: torch.Tensor) -> torch.Tensor:
    """The issue's example: a gradient penalty, a MAML inner step."""
    y = x.sin().exp()
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    return gx.cos()


def backward_with_graph(x: torch.Tensor) -> torch.Tensor:
    """`.backward(create_graph=True)` into a fresh non-leaf, whose `.grad` the result uses."""
    u = x * 1.0
    u.sin().exp().sum().backward(inputs=[u], create_graph=True)
    assert u.grad is not None
    return u.grad.cos() * u


def backward_without_graph(x: torch.Tensor) -> torch.Tensor:
    """`.backward()` into a leaf of the function's own, whose `.grad` (a constant) the result uses."""
    leaf = x.detach().requires_grad_()
    leaf.sin().exp().sum().backward()
    assert leaf.grad is not None
    return leaf.grad * x.sin().cos()


def grad_then_reuse(x: torch.Tensor) -> torch.Tensor:
    """Backward frees what it read; what comes after saves the input again."""
    z = x.sin().cos()
    (gx,) = torch.autograd.grad(z, x)
    return x.cos() * gx


def grad_keeping_graph(x: torch.Tensor) -> torch.Tensor:
    """Backward with `retain_graph=True`: the graph it read is used again by the result."""
    z = x.sin().cos()
    (gx,) = torch.autograd.grad(z, x, retain_graph=True)
    return gx * z


FUNCTIONS: dict[str, Fn] = {
    f.__name__: f
    for f in (
        plain, grads_without_graph, grad_with_graph, backward_with_graph, backward_without_graph, grad_then_reuse,
        grad_keeping_graph,
    )
}


def _compare(expected: Fn, actual: Fn, x: torch.Tensor) -> None:
    """Values, and one more derivative taken by the outer backward, equal; something was recomputed."""
    with recomputed():
        value = actual(x)
        torch.testing.assert_close(value, expected(x))
        (outer,) = torch.autograd.grad(value.sum(), x)
    (baseline,) = torch.autograd.grad(expected(x).sum(), x)
    torch.testing.assert_close(outer, baseline)


# -- the example --------------------------------------------------------------------------------------
@pytest.mark.parametrize("site", list(SITES))
def test_a_gradient_with_graph_inside_gives_first_second_and_third_derivatives(site: str) -> None:
    x = randn(5, requires_grad=True)
    for fn in (grad_with_graph, backward_with_graph):
        expected, actual = fn(x).sum(), SITES[site](fn)(x).sum()
        with recomputed():
            for _ in range(3):
                (expected,) = torch.autograd.grad(expected, x, create_graph=True)
                (actual,) = torch.autograd.grad(actual, x, create_graph=True)
                torch.testing.assert_close(actual, expected)
                expected, actual = expected.sum(), actual.sum()


# -- checkpoint in checkpoint, derivatives in between (PyTorch's table of nested checkpoints) -------------
def _table(fn: Fn, c: Site) -> list[tuple[Fn, Fn]]:
    """(without remat, with remat) pairs: sites wrapped around sites and derivatives, up to three deep."""
    return [
        (fn, c(fn)),
        (fn, c(c(fn))),
        (grad(fn), grad(c(fn))),
        (grad(fn), grad(c(c(fn)))),
        (grad(grad(fn)), grad(c(grad(fn)))),
        (grad(grad(fn)), c(grad(grad(c(fn))))),
        (grad(grad(fn)), grad(c(grad(c(fn))))),
        (grad(grad(grad(fn))), grad(c(grad(grad(c(fn)))))),
        (grad(grad(grad(fn))), grad(c(grad(c(grad(c(fn))))))),
    ]


@pytest.mark.parametrize("function", list(FUNCTIONS))
@pytest.mark.parametrize("site", list(SITES))
def test_sites_and_derivatives_nested(site: str, function: str) -> None:
    x = randn(requires_grad=True, seed=1)
    for expected, actual in _table(FUNCTIONS[function], SITES[site]):
        _compare(expected, actual, x)
        graph_dies(actual)


@pytest.mark.parametrize(("outer", "inner"), list(itertools.product(NESTING, repeat=2)))
def test_a_site_around_two_nested_sites(outer: str, inner: str) -> None:
    c, i = SITES[outer], SITES[inner]

    def first(x: torch.Tensor) -> torch.Tensor:
        return x.sin().exp().sin()

    def second(x: torch.Tensor) -> torch.Tensor:
        return x.cos().sin().exp()

    def both(x: torch.Tensor) -> torch.Tensor:
        return i(second)(i(first)(x))

    a = randn(3, 3, requires_grad=True, seed=2)
    expected = grad(total(grad(total(lambda x: second(first(x))))))
    for actual in (grad(total(grad(total(c(both))))), grad(total(c(grad(total(c(both))))))):
        _compare(expected, actual, a)
    for made in (grad(c(both)), grad(total(grad(total(c(both))))), grad(total(c(grad(total(c(both))))))):
        graph_dies(lambda x, made=made: made(x).sum())


@pytest.mark.parametrize("sites", list(itertools.product(NESTING, repeat=3)), ids="/".join)
def test_three_sites_deep_of_any_kind(sites: tuple[str, str, str]) -> None:
    outer, middle, inner = (SITES[name] for name in sites)
    x = randn(requires_grad=True, seed=4)
    for fn in (plain, grads_without_graph, grad_with_graph, backward_with_graph):
        _compare(grad(grad(grad(fn))), grad(outer(grad(middle(grad(inner(fn)))))), x)
        nested = outer(middle(inner(fn)))
        with recomputed():
            expected, actual = fn(x), nested(x)
            for _ in range(3):
                (expected,) = torch.autograd.grad(expected, x, create_graph=True)
                (actual,) = torch.autograd.grad(actual, x, create_graph=True)
                torch.testing.assert_close(actual, expected)
        graph_dies(grad(grad(nested)))


# -- the rest of PyTorch's nested-checkpoint scenarios -------------------------------------------------------
@pytest.mark.parametrize("site", list(SITES))
def test_tensor_and_other_arguments_and_results(site: str) -> None:
    def fn(k: int, a: torch.Tensor, b: torch.Tensor, f: Fn) -> tuple[torch.Tensor, int, str]:
        return f(k * a * b.exp()), 1, "abcd"

    a, b = randn(requires_grad=True, seed=5), randn(requires_grad=True, seed=6)
    with recomputed():
        out, one, text = SITES[site](fn)(3, a, b, torch.sin)
        actual = torch.autograd.grad(out, (a, b))
    assert (one, text) == (1, "abcd")
    torch.testing.assert_close(actual, torch.autograd.grad(fn(3, a, b, torch.sin)[0], (a, b)))


@pytest.mark.parametrize("site", list(SITES))
def test_keyword_arguments(site: str) -> None:
    def fn(a: torch.Tensor, blah: torch.Tensor | None = None) -> torch.Tensor:
        out = a.sin().exp()
        if blah is not None:
            out = out * blah
        return out.sin().exp()

    a, b = randn(requires_grad=True, seed=7), randn(requires_grad=True, seed=8)
    with recomputed():
        actual = torch.autograd.grad(SITES[site](fn)(a, blah=b), (a, b))
    torch.testing.assert_close(actual, torch.autograd.grad(fn(a, blah=b), (a, b)))


@pytest.mark.parametrize("site", list(SITES))
def test_backward_runs_on_the_graph_forward_made(site: str) -> None:
    """A hook on a node of forward's graph runs once: backward goes through that graph, not recompute's."""
    calls = []
    a = randn(requires_grad=True, seed=9)
    out = SITES[site](lambda t: t.sin().cos().sin())(a)
    out.grad_fn.next_functions[0][0].register_hook(lambda *_: calls.append(1))
    with recomputed():
        out.backward()
    assert calls == [1]
    torch.testing.assert_close(a.grad, torch.autograd.grad(a.sin().cos().sin(), a)[0])


@pytest.mark.parametrize("site", list(SITES))
def test_a_backward_started_from_a_hook_during_backward(site: str) -> None:
    """A hook on the output runs another backward, over part of the site's graph, while the first one runs."""
    a = randn(requires_grad=True, seed=10)
    inner, out = SITES[site](lambda t: (t.sin().cos(), t.sin().cos().sin()))(a)
    out.grad_fn.register_hook(lambda *_: inner.backward(retain_graph=True))
    with recomputed():
        out.backward(retain_graph=True)
    b = a.detach().requires_grad_()
    plain_inner, plain_out = b.sin().cos(), b.sin().cos().sin()
    plain_out.grad_fn.register_hook(lambda *_: plain_inner.backward(retain_graph=True))
    plain_out.backward(retain_graph=True)
    torch.testing.assert_close(a.grad, b.grad)


def test_checkpoint_sequential_under_a_gradient_with_graph() -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(4)), torch.nn.Tanh()).double()
    x = randn(2, 6, requires_grad=True, seed=11)
    ones = torch.ones(2, 6, dtype=torch.float64)
    expected = torch.autograd.grad(model(x), x, ones, create_graph=True)[0]
    with recomputed():
        actual = torch.autograd.grad(
            remat.checkpoint_sequential(model, 2, x, use_reentrant=False), x, ones, create_graph=True
        )[0]
        torch.testing.assert_close(actual, expected)
        torch.testing.assert_close(torch.autograd.grad(actual.sum(), x), torch.autograd.grad(expected.sum(), x))


@pytest.mark.parametrize(
    "options",
    [{"policy": policies.save_matmuls}, {"policy": policies.save_tagged("h")}, {"offload": True},
     {"offload": True, "policy": policies.save_matmuls | policies.save_tagged("h")}],
    ids=["save_matmuls", "save_tagged", "offload", "offload and both"],
)
@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_a_gradient_inside_a_site_with_a_policy(strategy: str, options: dict[str, Any]) -> None:
    """Kept outputs and tags reach recompute without cutting the graph the function differentiates."""
    w = randn(4, 4, requires_grad=True, seed=13)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = remat.tag((x @ w).tanh(), "h")
        (gx,) = torch.autograd.grad(h.sum(), x, create_graph=True)
        return ((gx @ w).sin() * h).exp()

    def derivatives(f: Fn, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        first = torch.autograd.grad(f(x).sum(), (x, w), create_graph=True)
        return (*first, *torch.autograd.grad(sum(g.sum() for g in first), (x, w)))

    x = randn(3, 4, requires_grad=True, seed=14)
    with recomputed():
        actual = derivatives(remat.remat(fn, strategy=strategy, **options), x)  # type: ignore[call-overload]
    torch.testing.assert_close(actual, derivatives(fn, x))


@pytest.mark.parametrize("inner", ["@remat", "@remat replay"])
@pytest.mark.parametrize("shape", ["site inside the region", "gradient through an earlier site"])
def test_random_ops_rebuilt_while_a_region_records(shape: str, inner: str) -> None:
    """A recompute that a region's forward causes runs under its own RNG state: the region's replay must not run
    it again under the region's (it would draw other dropout masks)."""

    def noisy(x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.dropout(x.sin(), 0.5, training=True).exp()
        (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return gx.cos() * y

    def through_earlier(site: Fn) -> Fn:
        def block(x: torch.Tensor) -> torch.Tensor:
            y = site(x.cos())
            (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            return (gx * y).sin()

        return block

    def build(site: Fn) -> Fn:
        if shape == "site inside the region":
            return lambda x: site(x.cos()).sin()
        return through_earlier(site)

    x = randn(6, requires_grad=True, seed=15)
    torch.manual_seed(0)
    expected = torch.autograd.grad(build(noisy)(x).sum(), x)[0]
    torch.manual_seed(0)
    with recomputed():
        actual = torch.autograd.grad(_block(build(SITES[inner](noisy)))(x).sum(), x)[0]
    torch.testing.assert_close(actual, expected)


# -- leaks ----------------------------------------------------------------------------------------------------
MODES: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "backward": lambda loss, x: loss.backward(),
    "create_graph": lambda loss, x: torch.autograd.grad(loss, x, create_graph=True)[0].sum().backward(),
    "graph dropped": lambda loss, x: None,
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("site", ["checkpoint", "@remat", "@remat replay", "with remat.region()", "nested"])
def test_nothing_a_gradient_inside_made_stays_alive(site: str, mode: str) -> None:
    made: list[weakref.ref[Any]] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        y = (x @ x.T).tanh().exp()
        (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        out = (gx.sin() * y.sum()).exp()
        if not made:  # forward's tensors only (recompute runs this again)
            made.extend(weakref.ref(t) for t in (y, gx, out))
            made.extend(weakref.ref(t.untyped_storage()) for t in (y, gx, out))
        return out

    wrap = (lambda fn: SITES["@remat"](SITES["@remat replay"](fn))) if site == "nested" else SITES[site]
    refs: list[weakref.ref[Any]] = []
    for _ in range(2):
        made.clear()
        x = randn(3, 4, requires_grad=True, seed=12)
        with recomputed():  # in forward already: the gradient inside reads what the site does not keep
            loss = wrap(body)(x).sum()
            MODES[mode](loss, x)
        refs += [weakref.ref(x), *made]
        del x, loss
    gc.collect()
    assert [ref for ref in refs if ref() is not None] == []
