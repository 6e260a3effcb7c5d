"""Tests of the replay tape's structure: what its entries hold, and plans shared between tapes (spec §3.2)."""
# mypy: disable-error-code="no-untyped-call,no-any-return"

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch

from remat._engine.region import RegionFrame, begin, end


@pytest.fixture(autouse=True)
def _float64() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _recorded(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, RegionFrame]:
    token = begin(site="test")
    try:
        out = fn(x)
    finally:
        end(token)
    assert isinstance(token, RegionFrame)
    return out, token


def test_inputs_of_ops_taking_tensor_lists_are_not_held_by_the_tape() -> None:
    x = torch.randn(4, requires_grad=True)
    refs: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        a, b = x.sin(), x.cos()
        refs.extend((weakref.ref(a), weakref.ref(b)))
        return torch.cat([a, b]).exp()  # exp saves its output: the tape lives until backward

    _recorded(fn, x)  # the first call of an op takes the general path: the second must hold nothing either
    refs.clear()
    out, frame = _recorded(fn, x)
    gc.collect()
    assert frame.tape is not None
    assert all(ref() is None for ref in refs), "the tape kept cat's inputs alive"
    out.sum().backward()
    y = x.detach().requires_grad_()
    torch.cat([y.sin(), y.cos()]).exp().sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
