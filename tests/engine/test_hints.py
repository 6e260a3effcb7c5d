"""Mismatch errors name the common causes they can see (issue 11): a cache among the arguments, `use_cache=True`,
a module that changes its own Python attributes; and say nothing extra when they see none."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import randn
from torch import nn

import remat


class ToyCache:
    """Like a transformers KV cache: `update` appends keys and returns everything so far."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []

    def update(self, keys: torch.Tensor) -> torch.Tensor:
        self.keys.append(keys)
        return torch.cat(self.keys, dim=0)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor, cache: ToyCache | None = None, use_cache: bool = False) -> torch.Tensor:
        keys = self.proj(x)
        if cache is not None:
            keys = cache.update(keys)
        return (keys.sin().sum(0) * x).sum(-1)


def _mismatch(module: nn.Module, *args: Any, **kwargs: Any) -> str:
    out = remat(module)(randn(3, 4, requires_grad=True), *args, **kwargs)
    with pytest.raises(remat.RecomputeMismatchError) as info:
        out.sum().backward()
    return str(info.value)


def test_a_cache_among_the_arguments_is_named_with_the_fix() -> None:
    message = _mismatch(Attention(), cache=ToyCache())
    assert "cache object, `cache` (a `ToyCache`)" in message
    assert "`use_cache=False`" in message and "strategy='replay'" in message
    assert "Python attributes" not in message  # the cache lives outside the module


def test_a_positional_cache_is_named_by_position() -> None:
    message = _mismatch(Attention(), ToyCache())
    assert "`positional argument #1` (a `ToyCache`)" in message


def test_use_cache_true_is_named() -> None:
    class Builds(Attention):
        def forward(self, x: torch.Tensor, cache: ToyCache | None = None, use_cache: bool = False) -> torch.Tensor:
            return super().forward(x, self.cache if use_cache else None)

    module = Builds()
    module.cache = ToyCache()  # type: ignore[assignment]
    assert "`use_cache=True`" in _mismatch(module, use_cache=True)


class Counts(nn.Module):
    """Changes its own attribute on every call and branches on it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Module()
        self.inner.calls = 0  # type: ignore[assignment]
        self.proj = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inner.calls += 1  # type: ignore[operator]
        h = self.proj(x)
        return (h if self.inner.calls % 2 else h[:, :2]).sin()  # type: ignore[operator]


def test_a_module_that_changes_its_attributes_is_named() -> None:
    message = _mismatch(Counts())
    assert "Recompute changed Python attributes of `Counts` (`inner.calls`)" in message
    assert "strategy='replay'" in message


def test_replay_is_the_fix_the_hint_names() -> None:
    module = remat(Counts(), strategy="replay")
    x = randn(3, 4, requires_grad=True)
    module(x).sum().backward()
    assert x.grad is not None


def test_no_hint_without_a_visible_cause() -> None:
    state = {"wide": False}

    def flips(x: torch.Tensor) -> torch.Tensor:
        h = x.exp()
        return (torch.cat([h, h]) if state["wide"] else h).sin().sum() * x

    y = remat(flips)(randn(4, requires_grad=True))
    state["wide"] = True
    with pytest.raises(remat.RecomputeMismatchError) as info:
        y.sum().backward()
    message = str(info.value)
    assert "cache" not in message and "Python attributes" not in message
