"""Tests of the replay strategy: `Region` (`with remat.region()`), `call`, `begin_replay`/`end_replay`
(docs/guides/sites.md, 'Any block of code'; docs/design.md, 'Rerun and replay')."""
# mypy: disable-error-code="no-untyped-call,no-any-return"

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import expect_recompute_or_skip
from torch import nn

from remat._core import switch as _switch
from remat._core.errors import RecomputeMismatchError, RematError
from remat._core.options import Options
from remat._engine import rerun as _rerun
from remat._engine import stats as _stats
from remat._engine.region import Region, RegionFrame, begin_replay, end_replay

pytestmark = pytest.mark.usefixtures("float64_default")
EQUIVALENCE_HELPERS = ("compare(",)  # see NOTE [ Equivalence tests must fail without remat ] in conftest.py


def _no_state_left() -> None:
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert torch._C._len_torch_dispatch_stack() == 0


def _grads(out: Any, leaves: list[torch.Tensor]) -> list[torch.Tensor | None]:
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    loss = sum((o.double() * (i + 1.5)).sum() for i, o in enumerate(outs) if o.requires_grad)
    for leaf in leaves:
        leaf.grad = None
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    return [None if leaf.grad is None else leaf.grad.clone() for leaf in leaves]


def compare(
    setup: Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]],
    wrap: Callable[[Callable[..., Any], tuple[Any, ...]], Any] | None = None,
    seed: int = 0,
    expect_recompute: bool = True,
) -> list[Region]:
    """Run `fn(*args)` from a fresh `setup()` without remat and inside a region; compare everything.

    Outputs, gradients of every leaf that requires grad (inputs and module parameters), module buffers and the
    RNG state after backward must all be equal, and the remat run must have recomputed (the engine's counter)
    unless `expect_recompute=False`: a comparison that would pass without remat proves nothing.
    """
    expect_recompute_or_skip(expect_recompute)
    results = []
    recomputed = 0
    regions: list[Region] = []
    for use in (False, True):
        torch.manual_seed(seed)
        fn, args = setup()
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        modules = [a for a in args if isinstance(a, nn.Module)]
        if isinstance(fn, nn.Module):
            modules.append(fn)
        for module in modules:
            leaves.extend(p for p in module.parameters() if p.requires_grad)
        torch.manual_seed(seed + 1)
        if not use:
            out = fn(*args)
        elif wrap is not None:
            out = wrap(fn, args)
        else:
            region = Region(Options())
            with region:
                out = fn(*args)
            regions.append(region)
        _no_state_left()
        before = _stats.recomputes
        grads = _grads(out, leaves)
        recomputed += _stats.recomputes - before if use else 0
        buffers = [b.clone() for m in modules for b in m.buffers()]
        results.append((out, grads, buffers, torch.get_rng_state()))
    (out0, g0, b0, rng0), (out1, g1, b1, rng1) = results
    torch.testing.assert_close(out1, out0)
    assert len(g0) == len(g1)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a)
    torch.testing.assert_close(b1, b0)
    assert torch.equal(rng0, rng1)
    if expect_recompute:
        assert recomputed > 0, "remat recomputed nothing: the comparison would pass without remat"
    return regions


# -- gradients equal a run without remat ---------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.2), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1 if self.training else 0.0)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


def test_transformer_block_gradients_match() -> None:
    def setup() -> Any:
        mask = torch.ones(5, 5, dtype=torch.bool).tril()
        return Block(), (torch.randn(2, 5, 8, requires_grad=True), mask)

    (region,) = compare(setup)
    assert region.ops > 20
    assert region.freed_bytes > 0


def test_conv_batchnorm_updates_running_stats_once() -> None:
    def setup() -> Any:
        net = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 2, 1))
        return net, (torch.randn(2, 2, 6, 6, requires_grad=True),)

    compare(setup)


def test_dropout_masks_match_and_rng_after_backward_is_unchanged() -> None:
    def setup() -> Any:
        def fn(x: torch.Tensor) -> torch.Tensor:
            return F.dropout(F.dropout(x.sin(), 0.5) * 2, 0.3).cos()

        return fn, (torch.randn(50, requires_grad=True),)

    compare(setup)


@pytest.mark.parametrize("last", [False, True])
def test_an_op_that_fills_an_argument_it_saved(last: bool) -> None:
    """NOTE [ Replay script ], rule 3: `rrelu_with_noise` saves its noise before it fills it; replay took the noise
    as it was before the op (the input gradient off by 0.21)."""

    def setup() -> Any:
        fc, out = nn.Linear(8, 8), nn.Linear(8, 8)

        def fn(x: torch.Tensor, fc: nn.Module, out: nn.Module) -> torch.Tensor:
            h = F.rrelu(fc(x), training=True)
            return h.sum(-1) if last else out(torch.tanh(h)).sum(-1)

        return fn, (torch.randn(4, 8, requires_grad=True), fc, out)

    compare(setup)


def test_layer_norm_and_ops_with_several_outputs() -> None:
    def setup() -> Any:
        ln = nn.LayerNorm(6)

        def fn(x: torch.Tensor, ln: nn.Module) -> torch.Tensor:
            a, b = ln(x).chunk(2, dim=-1)
            c, d, e = x.split(2, dim=-1)
            rows = (a * b).unbind(0)
            return torch.stack([r.exp() for r in rows]).sum() + (c * d * e).tanh().sum()

        return fn, (torch.randn(3, 6, requires_grad=True), ln)

    compare(setup)


def test_no_grad_detach_and_integer_tensors_inside() -> None:
    def setup() -> Any:
        emb = nn.Embedding(10, 4)

        def fn(x: torch.Tensor, ids: torch.Tensor, emb: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
            with torch.no_grad():
                scale = x.abs().mean() + 1
            h = x.sin() * scale + x.detach().cos() * x
            idx = (h.argmax(dim=-1) + ids) % 10
            h = h * emb(idx).sum(-1, keepdim=True)
            picked = torch.gather(h, 1, idx.unsqueeze(1) % 4)
            return picked.exp(), idx

        return fn, (torch.randn(3, 4, requires_grad=True), torch.tensor([1, 2, 3]), emb)

    compare(setup)


def test_inplace_ops_on_tensors_made_inside() -> None:
    def setup() -> Any:
        def fn(x: torch.Tensor) -> torch.Tensor:
            h = x * 2
            h[0].mul_(3)  # in place through a view
            h.relu_()  # saves its result
            z = h.exp()
            y = z.sin()  # saves z
            z2 = z * 1
            z2.add_(1)
            w = torch.zeros_like(x)
            w[1:] = z[1:] * x[1:]
            return y * z2 + w.tanh() + h

        return fn, (torch.randn(4, 3, requires_grad=True),)

    compare(setup)


def test_views_and_factory_ops() -> None:
    def setup() -> Any:
        def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            h = (x @ w.t()).view(-1).reshape(3, 4).transpose(0, 1)[1:].expand(2, 3, 3)
            pos = torch.arange(3, dtype=x.dtype) + torch.zeros(3) + torch.randn(3)
            return (h * pos).sigmoid() * torch.tensor([1.0, 2.0, 3.0])

        return fn, (torch.randn(3, 5, requires_grad=True), torch.randn(4, 5, requires_grad=True))

    compare(setup)


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        sq = x * x
        ctx.save_for_backward(sq, x)
        return sq * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        sq, _ = ctx.saved_tensors
        return grad * 3 * sq


def test_custom_autograd_function() -> None:
    def setup() -> Any:
        return (lambda x: _Cube.apply(x.sin()).exp()), (torch.randn(5, requires_grad=True),)

    compare(setup)


def test_python_side_effects_do_not_change_backward() -> None:
    calls = []

    def setup() -> Any:
        def fn(x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return x.sin() * len(calls) if len(calls) % 2 else x.cos() * 5

        return fn, (torch.randn(4, requires_grad=True),)

    torch.manual_seed(0)
    fn, (x,) = setup()
    with Region(Options()):
        y = fn(x)
    calls.append(1)  # a rerun would now take the other branch
    (g,) = torch.autograd.grad(y.sum() * 1.0, x)
    torch.testing.assert_close(g, x.cos() * 1)


# -- nesting ---------------------------------------------------------------------------------------------
def test_nested_regions() -> None:
    def wrap(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        (x,) = args
        with Region(Options()):
            h = x.sin() * 2
            with Region(Options()):
                h = h.exp() * x
                with Region(Options()):
                    h = h.tanh() * h
            h = h.cos() * h
        return h

    compare(lambda: (lambda x: ((x.sin() * 2).exp() * x).tanh(), (torch.randn(6, requires_grad=True),)))

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.sin() * 2
        h = h.exp() * x
        h = h.tanh() * h
        return h.cos() * h

    compare(lambda: (fn, (torch.randn(6, requires_grad=True),)), wrap)


@pytest.mark.ignores_switch  # the engine's entry points, called directly
def test_region_inside_rerun_and_rerun_inside_region() -> None:
    def inner(h: torch.Tensor) -> torch.Tensor:
        return F.dropout(h.exp(), 0.3) * h

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.sin() * 2
        h = inner(h).tanh()
        return h.cos() * h

    def rerun_outside(f: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        def body(x: torch.Tensor) -> torch.Tensor:
            h = x.sin() * 2
            with Region(Options()):
                h = inner(h).tanh()
            return h.cos() * h

        return _rerun.call(body, args, {}, site="outer")

    def region_outside(f: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        with Region(Options()):
            (x,) = args
            h = x.sin() * 2
            h = _rerun.call(inner, (h,), {}, site="inner").tanh()
            return h.cos() * h

    setup = lambda: (fn, (torch.randn(6, requires_grad=True),))  # noqa: E731
    compare(setup, rerun_outside)
    compare(setup, region_outside)


# -- writes to tensors from outside ---------------------------------------------------------------------
def test_inplace_on_outside_tensor_happens_once_and_replay_never_touches_it() -> None:
    def setup() -> Any:
        buf = torch.zeros(3)

        def fn(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
            before = (x + buf).sin()  # reads buf before the write
            buf.add_(x.detach())
            buf.detach()[0] += 1  # through an alias made inside
            return before + (x * buf).cos()

        return fn, (torch.randn(3, requires_grad=True), buf)

    compare(setup)
    torch.manual_seed(0)
    fn, (x, buf) = setup()
    with Region(Options()):
        y = fn(x, buf)
    after_forward = buf.clone()
    y.sum().backward()
    assert torch.equal(buf, after_forward)


def test_outside_tensor_modified_after_forward_raises_autograds_error() -> None:
    x = torch.randn(4, requires_grad=True)
    c = torch.randn(4)  # read by the tape, not saved by autograd
    with Region(Options()):
        y = ((x + c) ** 2).sum()
    c.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()

    w = torch.randn(4)  # saved by autograd (kept by reference)
    with Region(Options()):
        y = (x.sin() * w).sum()
    w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_outside_tensor_saved_by_several_ops_is_checked_at_each_version() -> None:
    # The pack hook gives autograd one token for an outside tensor saved again at the same version.
    x = torch.randn(4, requires_grad=True)
    w = torch.randn(4)
    with Region(Options()):
        y = (x * w * w).sin().sum()
    w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()

    def setup() -> Any:
        def fn(x: torch.Tensor, w: torch.Tensor, bn: nn.BatchNorm1d) -> torch.Tensor:
            a = x + w  # reads w at version 0 (add saves nothing)
            w.add_(1)  # a write to outside memory inside the block: replay writes to a copy
            return (a * w).sin() + bn(x) * w  # saves w at version 1, twice

        return fn, (torch.randn(2, 4, requires_grad=True), torch.randn(4), nn.BatchNorm1d(4))

    compare(setup)
    fn, (x, w, bn) = setup()
    with Region(Options()):
        y = fn(x, w, bn)
    y.sum().backward()
    assert int(bn.num_batches_tracked) == 1


# -- memory ----------------------------------------------------------------------------------------------
def test_memory_held_for_backward_is_about_the_outside_inputs() -> None:
    from remat._measure.track import track

    x = torch.randn(128, 128, requires_grad=True)
    w = torch.randn(128, 128, requires_grad=True)

    def fn() -> torch.Tensor:
        h = x
        for _ in range(8):
            h = (h @ w).tanh() * 0.5
        return h.sum()

    with track() as plain:
        y0 = fn()
    with track() as replay:
        with Region(Options()) as r:
            y1 = fn()
    held_plain, held_replay = plain.current_bytes, replay.current_bytes
    assert held_plain > 8 * 128 * 128 * 8  # every tanh output, at least
    assert held_replay <= 64  # the scalar output; x and w are outside the block and not counted
    assert r.freed_bytes >= 8 * 128 * 128 * 8
    y0.backward()
    g0 = w.grad.clone()  # type: ignore[union-attr]
    w.grad = None
    y1.backward()
    torch.testing.assert_close(w.grad, g0)


# -- exceptions, switch, threads, leaks ------------------------------------------------------------------
def test_exception_inside_leaves_nothing_behind_and_training_continues() -> None:
    x = torch.randn(3, requires_grad=True)
    region = Region(Options())
    with pytest.raises(ValueError, match="boom"):
        with region:
            x.sin()
            raise ValueError("boom")
    _no_state_left()

    @Region(Options())
    def bad(t: torch.Tensor) -> torch.Tensor:
        t.sin()
        raise KeyError("inner")

    with pytest.raises(KeyError):
        bad(x)
    _no_state_left()
    compare(lambda: ((lambda t: t.sin().exp()), (torch.randn(3, requires_grad=True),)))


def test_switch_and_enabled_false_run_the_block_untouched() -> None:
    x = torch.randn(3, requires_grad=True)
    for region, context in (
        (Region(Options()), _switch.enabled(False)),
        (Region(Options(enabled=False)), _switch.enabled(True)),
        (Region(Options()), torch.no_grad()),
    ):
        with context, region:
            assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
            assert torch._C._len_torch_dispatch_stack() == 0
            x.sin().exp()
        assert region.ops == 0
    with _switch.enabled(False):
        with Region(Options(enabled=True)) as r:
            y = x.sin().exp()
    assert r.ops == 2
    y.sum().backward()


def test_two_threads_at_once() -> None:
    torch.manual_seed(0)
    block = Block()
    block.eval()  # no dropout: the threads share the generator
    inputs = [torch.randn(2, 5, 8, requires_grad=True) for _ in range(2)]
    expected = [torch.autograd.grad(block(x).sum(), x)[0] for x in inputs]
    errors: list[BaseException] = []
    region = Region(Options())  # one object, entered by both threads at once

    def work(i: int) -> None:
        try:
            for _ in range(15):
                with region:
                    y = block(inputs[i])
                (g,) = torch.autograd.grad(y.sum(), inputs[i])
                torch.testing.assert_close(g, expected[i])
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_no_leaks_after_backward_or_after_dropping_the_graph() -> None:
    for run_backward in (True, False):
        x = torch.randn(16, requires_grad=True)
        c = torch.randn(16)
        token = begin_replay(site="leak", check=True, preserve_rng=True, debug=False)
        inside = x.sin() * c
        y = (inside.exp() * inside).sum()
        end_replay(token)
        refs = [weakref.ref(t) for t in (token, inside, c)]
        del token, inside, c
        if run_backward:
            y.backward()
        del y
        gc.collect()
        assert all(ref() is None for ref in refs), run_backward


# -- autograd API ----------------------------------------------------------------------------------------
def test_retain_graph_backward_twice_replays_twice() -> None:
    x = torch.randn(5, requires_grad=True)
    y0 = (x.sin().exp() * x).sum()
    (g0,) = torch.autograd.grad(y0, x)
    with Region(Options()):
        y = (x.sin().exp() * x).sum()
    before = _stats.recomputes
    y.backward(retain_graph=True)
    y.backward()
    assert _stats.recomputes - before == 2
    torch.testing.assert_close(x.grad, 2 * g0)


def test_autograd_grad_on_a_subset_of_inputs() -> None:
    a, b = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    with Region(Options()):
        y = (a.sin() * b.exp()).tanh().sum() + (b.cos() * 3).sum()
    (gb,) = torch.autograd.grad(y, b)
    expected = torch.autograd.grad(
        (a.sin() * b.exp()).tanh().sum() + (b.cos() * 3).sum(), b
    )[0]
    torch.testing.assert_close(gb, expected)


def test_create_graph_double_backward() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            k = x.abs().sum()
        return ((x * w).tanh() ** 3 * k + x.detach() * w).sum()

    results = []
    for use in (False, True):
        torch.manual_seed(0)
        x, w = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
        if use:
            with Region(Options()):
                y = fn(x, w)
        else:
            y = fn(x, w)
        gx, gw = torch.autograd.grad(y, (x, w), create_graph=True)
        (gx.pow(2).sum() + gw.sin().sum()).backward()
        results.append((gx.detach(), x.grad, w.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a)


def test_outputs_keep_their_requires_grad() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    with Region(Options()):
        idx = x.argmax(-1)
        frozen = x.detach() * 2
        y = x.sin()
    assert not idx.requires_grad and not frozen.requires_grad and y.requires_grad


# -- forms: decorator, call, begin/end, re-entry ---------------------------------------------------------
def test_decorator_on_function_and_method_and_call() -> None:
    @Region(Options())
    def fn(x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        """Doc."""
        return x.sin().exp() * scale

    assert fn.__name__ == "fn" and fn.__doc__ == "Doc."

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @Region(Options())
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).tanh()

    compare(lambda: ((lambda x: fn(x, scale=2.0)), (torch.randn(4, requires_grad=True),)))
    compare(lambda: (Net(), (torch.randn(2, 4, requires_grad=True),)))
    compare(
        lambda: ((lambda x: (x.sin() * x).exp()), (torch.randn(4, requires_grad=True),)),
        lambda f, args: Region(Options(name="fn"))(f)(*args),
    )


def test_region_can_be_entered_again_and_recursively() -> None:
    region = Region(Options())
    x = torch.randn(4, requires_grad=True)
    for n in (1, 3):
        with region:
            y = x
            for _ in range(n):
                y = y.sin()
        assert region.ops == n
        y.sum().backward()

    @region
    def rec(t: torch.Tensor, depth: int) -> torch.Tensor:
        return t if depth == 0 else rec(t.sin() * t, depth - 1).exp()

    compare(lambda: ((lambda t: rec(t, 3)), (torch.randn(3, requires_grad=True),)))


@pytest.mark.ignores_switch  # the engine's entry points, called directly
def test_begin_end_around_code() -> None:
    def wrap(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        token = begin_replay(site="block", check=True, preserve_rng=True, debug=False)
        try:
            out = fn(*args)
        finally:
            end_replay(token)
        assert isinstance(token, RegionFrame)
        return out

    compare(lambda: (Block(), (torch.randn(2, 3, 8, requires_grad=True),)), wrap)
    with torch.no_grad():
        assert begin_replay(site="x", check=True, preserve_rng=True, debug=False) is None
    end_replay(None)
    _no_state_left()


def test_replay_stops_after_the_last_op_needed() -> None:
    x = torch.randn(4, requires_grad=True)
    token = begin_replay(site="stop", check=True, preserve_rng=True, debug=True)
    y = x.exp()  # saves its output
    for _ in range(5):
        y = y + 1  # add saves nothing
    end_replay(token)
    y.sum().backward()
    assert isinstance(token, RegionFrame)
    assert token.retrace is not None and len(token.retrace) == 1
    torch.testing.assert_close(x.grad, x.exp())


# -- debug -------------------------------------------------------------------------------------------------
def test_debug_finds_writes_outside_the_dispatcher() -> None:
    x = torch.randn(4, requires_grad=True)
    for debug in (False, True):
        with Region(Options(debug=debug)):
            h = x * 2
            h.detach().numpy()[0] = 100.0  # invisible to the tape
            y = h.sin().sum()
        if debug:
            with pytest.raises(RecomputeMismatchError, match=r"aten\.mul\.Tensor"):
                y.backward()
        else:
            y.backward()  # documented limitation: replay cannot see such writes


def test_errors_derive_from_remat_error() -> None:
    x = torch.randn(4, requires_grad=True)
    c = torch.randn(4)
    with Region(Options(name="my block")):
        y = ((x + c) ** 2).sum()
    c.add_(1)
    with pytest.raises(RematError, match="`my block`"):
        y.backward()


# -- more corners ------------------------------------------------------------------------------------------
def test_nested_region_holds_no_activation_of_the_outer_one() -> None:
    from remat._measure.track import track

    x = torch.randn(64, 64, requires_grad=True)
    with track() as t:
        with Region(Options()):
            h = x.tanh() * 3  # an activation of the outer region
            with Region(Options()):
                y = (h.sin() * h).exp().sum()  # saves h: it must go to the outer hooks, not be kept
            del h
    assert t.current_bytes <= 64  # only the scalar output
    (g,) = torch.autograd.grad(y, x)
    h = x.tanh() * 3
    (expected,) = torch.autograd.grad((h.sin() * h).exp().sum(), x)
    torch.testing.assert_close(g, expected)


def test_random_ops_with_their_own_generator() -> None:
    def setup() -> Any:
        gen = torch.Generator().manual_seed(3)

        def fn(x: torch.Tensor) -> torch.Tensor:
            noise = torch.rand(x.shape, generator=gen)
            return (x.sin() * noise).exp() * torch.bernoulli(torch.full_like(x, 0.5), generator=gen)

        return fn, (torch.randn(6, requires_grad=True),)

    compare(setup)


def test_saved_tensor_written_later_in_the_block_is_rebuilt_with_its_saved_value() -> None:
    x = torch.randn(3, requires_grad=True)
    with Region(Options()):
        h = x.exp()  # saves its output h
        out = (h * 1).sum()
        with torch.no_grad():
            h.detach().zero_()  # without remat, backward would raise; replay clones h before the write
        later = (x * 2).sin().sum()  # saves x * 2: replay runs past the write
    (g,) = torch.autograd.grad(out + later, x)
    torch.testing.assert_close(g, x.detach().exp() + 2 * (x.detach() * 2).cos())


@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's own warnings while tracing
def test_compiled_function_inside_a_region() -> None:
    @torch.compile(backend="eager")
    def f(t: torch.Tensor) -> torch.Tensor:
        return (t.sin() * 2).exp()

    compare(lambda: (f, (torch.randn(5, requires_grad=True),)))


def test_autocast_in_forward_is_replayed_exactly() -> None:
    def setup() -> Any:
        lin = nn.Linear(4, 4)

        def fn(x: torch.Tensor, lin: nn.Module) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = lin(x).relu()
            return h.float().exp()

        return fn, (torch.randn(3, 4, requires_grad=True), lin)

    compare(setup)
