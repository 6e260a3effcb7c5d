"""Early stop as torch stops: during recompute, none of the user's code after the last tensor backward needs runs
again — also when forward saved nothing after it (a trailing `clone`, a log call, a Python counter).

Each test counts the trailing code, compares gradients with the same code run without remat (float64), and
checks that something was recomputed, so that it fails with `REMAT=0`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from conftest import randn
from torch import nn

import remat
from remat._engine import hooks
from remat._engine import stats as _stats

Fn = Callable[..., Any]


@contextmanager
def recomputed() -> Iterator[None]:
    before = _stats.recomputes
    yield
    assert _stats.recomputes > before, "nothing was recomputed: remat was not active"


class Trailing:
    """A function whose last needed tensor is followed by code that saves nothing: `tail` runs it."""

    def __init__(self, tail: str) -> None:
        self.tail = tail
        self.runs = 0
        self.log = logging.getLogger(f"remat.tests.early_stop.{tail}")

    def clone(self, t: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return t.clone()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.sin().exp()  # exp saves its output: the last tensor backward needs
        if self.tail == "clone":
            return self.clone(h)
        if self.tail == "log":
            self.log.warning("step done")
        else:
            self.runs += 1
        return h * 2.0  # a scalar mul saves nothing


SITES: dict[str, Callable[[Fn], Fn]] = {
    "checkpoint": lambda fn: lambda x: remat.checkpoint(fn, x, use_reentrant=False),
    "@remat": lambda fn: remat.remat(fn),
    "@remat replay": lambda fn: remat.remat(fn, strategy="replay"),
    "@remat.region()": lambda fn: remat.region()(fn),
}


def _runs(fn: Trailing, caplog: pytest.LogCaptureFixture) -> int:
    if fn.tail == "log":
        return sum(record.name == fn.log.name for record in caplog.records)
    return fn.runs


@pytest.mark.parametrize("tail", ["counter", "clone", "log"])
@pytest.mark.parametrize("site", list(SITES))
def test_trailing_code_runs_once(site: str, tail: str, caplog: pytest.LogCaptureFixture) -> None:
    x = randn(5, requires_grad=True)
    fn = Trailing(tail)
    with caplog.at_level(logging.WARNING), recomputed():
        (actual,) = torch.autograd.grad(SITES[site](fn)(x).sum(), x)
    assert _runs(fn, caplog) == 1, "the code after the last needed tensor ran again in recompute"
    torch.testing.assert_close(actual, torch.autograd.grad(Trailing(tail)(x).sum(), x)[0])


class Counting:
    """A context manager whose exit is user code that runs after the block's last op."""

    def __init__(self) -> None:
        self.exits = 0

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        self.exits += 1


def _exp(t: torch.Tensor) -> torch.Tensor:
    return t.exp()


@pytest.mark.parametrize(("shape", "runs"), [("with", 2), ("finally", 2), ("helper", 1), ("return", 0)])
def test_code_after_the_op_a_return_hands_back_runs_as_under_torch(shape: str, runs: int) -> None:
    """The last needed tensor is saved by the op whose result a `return` hands back. What follows it in the
    function (the caller of a helper) does not run again; a `with` block's exit and a `finally` body run while
    the stop unwinds, under torch's checkpoint as under remat's; with nothing after it, nothing runs at all."""
    counter = Counting()

    def with_block(x: torch.Tensor) -> torch.Tensor:
        with counter:
            return x.sin().exp()

    def with_finally(x: torch.Tensor) -> torch.Tensor:
        try:
            return x.sin().exp()
        finally:
            counter.exits += 1

    def with_helper(x: torch.Tensor) -> torch.Tensor:
        out = _exp(x.sin())
        counter.exits += 1
        return out

    def just_return(x: torch.Tensor) -> torch.Tensor:
        return _exp(x.sin())

    fn = {"with": with_block, "finally": with_finally, "helper": with_helper, "return": just_return}[shape]
    x = randn(5, requires_grad=True)
    torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False).sum().backward()
    assert counter.exits == runs
    counter.exits = 0
    with recomputed():
        (actual,) = torch.autograd.grad(remat.remat(fn)(x).sum(), x)
    assert counter.exits == runs
    torch.testing.assert_close(actual, torch.autograd.grad(fn(x).sum(), x)[0])


def test_trailing_code_of_a_module_runs_once() -> None:
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4).double()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.linear(x).tanh()
            self.calls += 1
            return h.clone()

    torch.manual_seed(0)
    layer, plain = Layer(), Layer()
    plain.load_state_dict(layer.state_dict())
    remat.remat(layer)
    x = randn(3, 4, requires_grad=True)
    with recomputed():
        layer(x).sum().backward()
    plain(x.detach().requires_grad_()).sum().backward()
    assert layer.calls == 1
    torch.testing.assert_close(layer.linear.weight.grad, plain.linear.weight.grad)


def test_trailing_code_of_nested_sites() -> None:
    """The inner site's tail comes before the outer site's last needed tensor: the outer recompute runs it once
    more (as torch's does); the inner site's own recompute stops before it, and the outer's tail never reruns."""
    inner, outer = Trailing("counter"), Trailing("counter")
    site = remat.remat(lambda x: outer(remat.remat(inner)(x).cos()))
    x = randn(5, requires_grad=True)
    with recomputed():
        (actual,) = torch.autograd.grad(site(x).sum(), x)
    assert (inner.runs, outer.runs) == (2, 1)
    expected = Trailing("counter")(Trailing("counter")(x).cos())
    torch.testing.assert_close(actual, torch.autograd.grad(expected.sum(), x)[0])


def test_trailing_code_after_a_gradient_inside_runs_once() -> None:
    """The backward inside rebuilds from the part of forward that has run: it stops there too."""
    runs = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        first = x.sin().exp().sin()
        (g,) = torch.autograd.grad(first, x, create_graph=True)
        out = (g * x).exp()
        runs.append(1)
        return out.clone()

    x = randn(requires_grad=True)
    with recomputed():
        (actual,) = torch.autograd.grad(remat.remat(fn)(x), x)
    assert len(runs) == 1
    runs.clear()
    torch.testing.assert_close(actual, torch.autograd.grad(fn(x), x)[0])


def test_without_early_stop_the_function_runs_to_its_end() -> None:
    """The drop-in's `early_stop=False` and torch's `set_checkpoint_early_stop`, with torch's precedence."""
    x = randn(5, requires_grad=True)

    def runs(early_stop: bool | None = None, switch: bool | None = None) -> int:
        fn = Trailing("clone")
        keywords = {} if early_stop is None else {"early_stop": early_stop}
        if switch is None:
            out = remat.checkpoint(fn, x, use_reentrant=False, **keywords)
        else:
            with torch.utils.checkpoint.set_checkpoint_early_stop(switch):
                out = remat.checkpoint(fn, x, use_reentrant=False, **keywords)
        with recomputed():
            out.sum().backward()  # the switch applies to sites made under it, also after it is left
        return fn.runs

    assert runs() == 1
    assert runs(early_stop=False) == 2
    assert runs(switch=False) == 2
    assert runs(early_stop=True, switch=False) == 2  # the global switch wins, as in torch
    assert runs(early_stop=False, switch=True) == 1


def test_the_outcome_never_depends_on_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that jumps by a minute at every reading changes nothing: where recompute stops, the gradients."""
    clock = iter(range(0, 10**9, 60))
    monkeypatch.setattr(hooks.time, "perf_counter", lambda: float(next(clock)))
    x = randn(5, requires_grad=True)
    fn = Trailing("counter")
    with recomputed():
        (actual,) = torch.autograd.grad(remat.remat(fn)(x).sum(), x)
    assert fn.runs == 1
    torch.testing.assert_close(actual, torch.autograd.grad(Trailing("counter")(x).sum(), x)[0])
