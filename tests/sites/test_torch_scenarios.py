"""Scenarios from PyTorch's own checkpoint tests where torch's checkpoint refuses or limits, and remat gives the
gradients of plain autograd instead.

Each runs the same code without any checkpoint as the baseline (float64, `assert_close`) and checks that remat
recomputed, so it fails when remat does nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_same_grads, randn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat
from remat._engine import stats as _stats

pytestmark = [pytest.mark.usefixtures("float64_default"), pytest.mark.equivalence]

Wrap = Callable[[Any], Callable[..., Any]]
VARIANTS: dict[str, Wrap] = {
    "checkpoint": lambda fn: lambda *args: remat.checkpoint(fn, *args, use_reentrant=False),
    "checkpoint, use_reentrant=True": lambda fn: lambda *args: remat.checkpoint(fn, *args, use_reentrant=True),
    "@remat": remat.remat,
    "@remat replay": lambda fn: remat.remat(strategy="replay")(fn),
}


class _ReadsSavedTwice(torch.autograd.Function):
    """exp(x * y), whose backward reads `ctx.saved_tensors` twice (torch's checkpoint refuses the second read)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = (x * y).exp()
        ctx.save_for_backward(x, y, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, out = ctx.saved_tensors
        again = ctx.saved_tensors
        assert all(torch.equal(first, second) for first, second in zip((x, y, out), again, strict=True))
        return grad * out * y, grad * out * x


def _custom(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _ReadsSavedTwice.apply(x.sin(), y.cos()).sum(0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_custom_function_reading_its_saved_tensors_twice(variant: str) -> None:
    inputs = (randn(3, 4, requires_grad=True), randn(3, 4, requires_grad=True, seed=1))
    assert_same_grads(lambda: _custom, inputs, VARIANTS[variant])


def test_two_overlapping_backwards_in_a_graph_exec_group() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.sin().cos()

    x = randn(3, 3, requires_grad=True)
    plain = fn(x)
    plain.sum().backward(retain_graph=True)
    plain.sum().backward()
    expected, x.grad = x.grad, None
    out = remat.checkpoint(fn, x, use_reentrant=False)
    before = _stats.recomputes
    with torch.utils.checkpoint.GraphExecGroup():  # torch's checkpoint raises here: the backwards overlap
        out.sum().backward(retain_graph=True)
        out.sum().backward()
    assert _stats.recomputes > before
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_second_derivative_through_checkpoint_sequential(use_reentrant: bool) -> None:
    """torch's reentrant checkpoint refuses `autograd.grad`; remat takes it, and a derivative of it."""
    torch.manual_seed(0)
    stages = [torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh()]
    x = randn(2, 6, requires_grad=True)

    def derivatives(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (first,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        (second,) = torch.autograd.grad(first.sin().sum(), x)
        return first.detach(), second

    expected = derivatives(torch.nn.Sequential(*stages)(x))
    before = _stats.recomputes
    got = derivatives(remat.checkpoint_sequential(stages, 2, x, use_reentrant=use_reentrant))
    assert _stats.recomputes > before
    torch.testing.assert_close(got, expected)


def test_a_hook_on_a_weight_used_inside_and_outside_runs_once() -> None:
    def run(site: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
        w, x = randn(4, 4, requires_grad=True), randn(4, 4, requires_grad=True, seed=1)
        calls: list[int] = []
        w.register_hook(lambda grad: calls.append(1))
        site(lambda h: (w * h).exp(), w * x).sum().backward()
        assert w.grad is not None and x.grad is not None
        return w.grad, x.grad, len(calls)

    expected = run(lambda fn, h: fn(h))
    before = _stats.recomputes
    got = run(lambda fn, h: remat.checkpoint(fn, h, use_reentrant=False))
    assert _stats.recomputes > before
    assert got[2] == expected[2] == 1
    torch.testing.assert_close(got[:2], expected[:2])


def test_reading_a_saved_result_outside_backward_recomputes_each_time() -> None:
    def fn(a: torch.Tensor) -> torch.Tensor:
        return (a * a).exp()

    a = randn(5, requires_grad=True)
    out = remat.checkpoint(fn, a, use_reentrant=False)
    for _ in range(2):
        before = _stats.recomputes
        torch.testing.assert_close(out.grad_fn._saved_result, fn(a).detach())
        assert _stats.recomputes == before + 1
    (got,) = torch.autograd.grad(out.sum(), a)
    (expected,) = torch.autograd.grad(fn(a).sum(), a)
    torch.testing.assert_close(got, expected)


def _keep_sin(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.sin.default else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("allow", [False, True], ids=["default", "allow_cache_entry_mutation"])
def test_version_counter(allow: bool) -> None:
    """PyTorch's TestSelectiveActivationCheckpoint::test_version_counter: `sin` is kept and `mul_` then changes it.
    torch raises "Tensor cached during selective activation checkpoint has been mutated", and with
    `allow_cache_entry_mutation=True` hands the changed tensor back (wrong gradients). remat runs `sin` again in
    recompute either way: the gradients of plain autograd (NOTE [ A kept output changed in place ])."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.sin().mul_(2).cos().exp()

    context_fn = functools.partial(create_selective_checkpoint_contexts, _keep_sin, allow_cache_entry_mutation=allow)
    assert_same_grads(lambda: fn, (randn(3, requires_grad=True),),
                      lambda f: functools.partial(remat.checkpoint, f, use_reentrant=False, context_fn=context_fn))
    x = randn(3, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
    if not allow:
        with pytest.raises(RuntimeError, match="has been mutated"):
            out.sum().backward()
