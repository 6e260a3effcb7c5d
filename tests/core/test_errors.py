"""Errors and robustness (docs/design.md, 'Errors and cleanup'; 'What remat guarantees' 7 to 9 and 14): recompute
mismatches are detected and named, debug traces, exceptions leave nothing behind, no leaks, threads, in-place
changes to inputs."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from conftest import assert_same_grads, hooks_installed, randn
from models import MLP
from torch import nn

import remat
from remat._core import switch as _switch

MODE = {"wide": False}


def flips(x: torch.Tensor) -> torch.Tensor:
    """Behaves differently when a global flag changes between forward and backward."""
    h = x.exp()
    if MODE["wide"]:
        h = torch.cat([h, h])
    return h.sin().sum() * x


@pytest.fixture
def flag() -> dict[str, bool]:
    MODE["wide"] = False
    yield MODE  # type: ignore[misc]
    MODE["wide"] = False


def test_mismatch_raises_naming_the_site_and_the_tensor(flag: dict[str, bool]) -> None:
    site = remat.remat(name="flaky block")(flips)
    y = site(randn(4, requires_grad=True))
    flag["wide"] = True
    with pytest.raises(remat.RecomputeMismatchError) as info:
        y.sum().backward()
    message = str(info.value)
    assert message.startswith("remat: ") and "`flaky block`" in message
    assert "saved tensor #1" in message and "shape (4,)" in message and "shape (8,)" in message
    assert "REMAT_DEBUG=1" in message
    assert isinstance(info.value, remat.RematError) and isinstance(info.value, RuntimeError)


def test_default_site_name_is_the_qualified_name(flag: dict[str, bool]) -> None:
    y = remat.remat(flips)(randn(4, requires_grad=True))
    flag["wide"] = True
    with pytest.raises(remat.RecomputeMismatchError, match="`flips`"):
        y.sum().backward()


def test_recompute_that_saves_fewer_tensors_is_detected() -> None:
    state = {"skip": False}

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.exp()
        if not state["skip"]:
            h = h.sin()
        return h.cos()

    y = remat.remat(fn)(randn(4, requires_grad=True))
    state["skip"] = True
    with pytest.raises(remat.RecomputeMismatchError, match="fn"):
        y.sum().backward()


def test_debug_shows_forward_and_recompute_traces_side_by_side(flag: dict[str, bool]) -> None:
    y = remat.checkpoint(flips, randn(4, requires_grad=True), debug=True)
    flag["wide"] = True
    with pytest.raises(remat.RecomputeMismatchError) as info:
        y.sum().backward()
    message = str(info.value)
    assert "Op traces (REMAT_DEBUG=1)" in message
    lines = message.splitlines()
    header = lines[lines.index("Op traces (REMAT_DEBUG=1):") + 1]
    marked = [line for line in lines if line.startswith(">> ")]
    assert header.split() == ["forward", "recompute"]
    assert len(marked) == 1 and "aten.cat" in marked[0] and "aten.sin" in marked[0]


def test_remat_debug_switch_turns_traces_on(flag: dict[str, bool], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_switch, "_debug", True)
    site = remat.remat(flips)  # the switch is read when the site is made
    y = site(randn(4, requires_grad=True))
    flag["wide"] = True
    with pytest.raises(remat.RecomputeMismatchError, match=r"(?s)Op traces.*>> "):
        y.sum().backward()


def test_check_false_skips_the_comparison() -> None:
    state = {"scale": 1.0}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x.exp() * state["scale"]).sin()  # same shapes either way, so only values differ

    x = randn(4, requires_grad=True)
    remat.remat(check=False)(fn)(x).sum().backward()  # nothing to detect, nothing raised
    torch.testing.assert_close(x.grad, (x.exp()).cos() * x.exp())


# -- exceptions leave nothing behind ----------------------------------------------------------------------
class Boom(Exception):
    pass


def test_exception_in_a_decorated_function_leaves_no_state() -> None:
    calls = {"n": 0}

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        h = x.sin().exp()
        if calls["n"] == 1:
            raise Boom
        return h

    site = remat.remat(fn)
    with pytest.raises(Boom):
        site(randn(4, requires_grad=True))
    assert not hooks_installed() and torch._C._len_torch_dispatch_stack() == 0
    calls["n"] = 1_000  # training continues
    assert_same_grads(lambda: fn, (randn(4, requires_grad=True),), lambda f: site)


def test_exception_in_a_module_forward_leaves_no_state() -> None:
    class Fails(MLP):
        fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = super().forward(x)
            if self.fail:
                raise Boom
            return h

    model = remat.remat(Fails().double())
    with pytest.raises(Boom):
        model(randn(4, 8, requires_grad=True))
    assert not hooks_installed()
    Fails.fail = False
    try:
        assert_same_grads(Fails, (randn(4, 8, requires_grad=True),), remat.remat)
    finally:
        Fails.fail = True


def test_exception_during_recompute_leaves_no_state() -> None:
    state = {"fail": False}

    def fn(x: torch.Tensor) -> torch.Tensor:
        if state["fail"]:
            raise Boom
        return x.sin().exp()

    site = remat.remat(fn)
    y = site(randn(4, requires_grad=True))
    state["fail"] = True
    with pytest.raises(Boom):
        y.sum().backward()
    assert not hooks_installed() and torch._C._len_torch_dispatch_stack() == 0
    state["fail"] = False
    assert_same_grads(lambda: fn, (randn(4, requires_grad=True),), lambda f: site)


# -- leaks ------------------------------------------------------------------------------------------------
def _watched() -> tuple[list[weakref.ref[torch.Tensor]], remat.Remat]:
    refs: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        refs.append(weakref.ref(h))
        return h.exp().cos()

    return refs, remat.remat(fn)  # type: ignore[return-value]


def test_no_leak_after_backward() -> None:
    refs, site = _watched()
    x = randn(100, requires_grad=True)
    y = site(x)
    y.sum().backward()
    assert len(refs) == 2, "forward and recompute"
    assert all(ref() is None for ref in refs), "an activation outlived backward while the output is alive"
    del y


def test_no_leak_after_dropping_the_graph_without_backward() -> None:
    refs, site = _watched()
    y = site(randn(100, requires_grad=True))
    assert refs[0]() is None, "the activation is freed at the end of forward"
    del y
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_no_leak_when_autograd_grad_skips_part_of_the_graph() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a = x.exp()
        b = w.sin()
        refs.extend((weakref.ref(a), weakref.ref(b)))
        return (a * b).tanh()

    x, w = randn(10, requires_grad=True), randn(10, requires_grad=True, seed=1)
    y = remat.remat(fn)(x, w)
    (gx,) = torch.autograd.grad(y.sum(), [x])
    assert all(ref() is None for ref in refs)
    expected = torch.autograd.grad(fn(x, w).sum(), [x])[0]
    torch.testing.assert_close(gx, expected)


def _frames() -> list[weakref.ref[object]]:
    gc.collect()
    return [weakref.ref(obj) for obj in gc.get_objects() if type(obj).__name__ == "RerunFrame"]


@pytest.mark.parametrize("create_graph", [False, True])
def test_frames_are_freed_with_the_graph(create_graph: bool) -> None:
    """Also after a double backward, where the recompute graph itself holds remat's hooks."""
    before = {id(ref()) for ref in _frames()}
    model = remat.remat(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Softplus()).double())
    y = model(randn(4, 8, requires_grad=True))
    refs = [ref for ref in _frames() if id(ref()) not in before]
    assert len(refs) == 1
    if create_graph:
        grads = torch.autograd.grad(y.sum(), list(model.parameters()), create_graph=True)
        sum((g * g).sum() for g in grads).backward()
        del grads
    else:
        y.sum().backward()
    del y
    gc.collect()
    assert refs[0]() is None


# -- threads ----------------------------------------------------------------------------------------------
def test_two_threads_train_concurrently_and_stay_correct() -> None:
    steps = 8
    barrier = threading.Barrier(2)
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)  # in the main thread: the CPU generator is shared by all threads
        return nn.Sequential(MLP(), nn.LayerNorm(8), MLP()).double()

    def train(model: nn.Module, seed: int, wait: bool) -> list[torch.Tensor]:
        grads = []
        for step in range(steps):
            if wait:
                barrier.wait(timeout=30)
            x = randn(4, 8, requires_grad=True, seed=100 * seed + step)
            model(x).square().sum().backward()
            grads.append(x.grad)
            grads.extend(p.grad.clone() for p in model.parameters())
            model.zero_grad()
        return grads

    models = {seed: remat.apply(build(seed), (MLP, nn.LayerNorm)) for seed in (1, 2)}

    def worker(seed: int) -> None:
        try:
            results[seed] = train(models[seed], seed, True)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    for seed in (1, 2):
        expected = train(build(seed), seed, False)
        assert len(results[seed]) == len(expected)
        for got, want in zip(results[seed], expected, strict=True):
            torch.testing.assert_close(got, want)


# -- in-place changes to inputs ---------------------------------------------------------------------------
def test_input_modified_in_place_after_forward_raises_like_autograd() -> None:
    x = randn(4, requires_grad=True)
    h = x * 2  # a non-leaf input to the site
    y = remat.remat(lambda t: t.sin().exp())(h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(remat.RematError, match="modified by an inplace operation") as info:
        y.sum().backward()
    assert "lambda" in str(info.value)
    assert not hooks_installed()


def test_input_modified_in_place_plain_autograd_raises_too() -> None:
    """The control: the same program without remat fails in autograd's own words."""
    x = randn(4, requires_grad=True)
    h = x * 2
    y = (lambda t: t.sin().exp())(h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_debug_traces_show_the_ops_only_recompute_ran() -> None:
    """The trace goes on past the point where recompute parted from forward (0.1.0 stopped right there)."""
    calls: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        h = x.exp()
        if len(calls) > 1:
            h = torch.cat([h, h])  # recompute only: cos then saves a tensor of another shape
        return h.cos().tanh()

    y = remat.checkpoint(fn, randn(4, requires_grad=True), use_reentrant=False, debug=True)
    with pytest.raises(remat.RecomputeMismatchError) as info:
        y.sum().backward()
    message = str(info.value)
    assert "aten.cat" in message
    assert "aten.cos.default[(8,)]" in message and "aten.tanh.default[(8,)]" in message
    assert "aten.cos.default[(4,)]" in message and "aten.tanh.default[(4,)]" in message


def test_debug_traces_of_a_region_show_ops_that_return_numbers() -> None:
    from remat._engine.region import RegionFrame, begin_replay, end_replay

    x = randn(4, requires_grad=True)
    token = begin_replay(site="numbers", check=True, preserve_rng=True, debug=True)
    y = x.exp() * x.detach().sum().item()  # `item` runs aten._local_scalar_dense, which returns a number
    end_replay(token)
    assert isinstance(token, RegionFrame) and token.trace is not None
    assert any("_local_scalar_dense" in line for line in token.trace), token.trace
    y.sum().backward()
