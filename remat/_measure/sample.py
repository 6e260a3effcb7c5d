"""The sample a budget is planned on (`remat.apply(..., sample=...)`): as a call, detached, and its signature."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._core.torch_compat import tree_leaves, tree_map

__all__ = ["as_call", "detached", "signature"]


def as_call(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`sample=` as positional and keyword arguments: a dict is keywords, a tuple positionals, else one argument.

    >>> as_call({"x": 1}), as_call((1, 2)), as_call(1)
    (((), {'x': 1}), ((1, 2), {}), ((1,), {}))
    """
    if isinstance(sample, Mapping):
        return (), dict(sample)
    if isinstance(sample, tuple):
        return sample, {}
    return (sample,), {}


def detached(value: Any) -> Any:
    """`value` with every tensor detached from its graph (floating ones keep `requires_grad`)."""
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.detach().requires_grad_(t.requires_grad and t.is_floating_point())
        return t

    return tree_map(one, value)


def signature(args: Any, kwargs: Any) -> tuple[Any, ...]:
    """Shape, dtype and device of each tensor in a call: a forward with another signature is planned again."""
    return tuple(
        (tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else None
        for t in tree_leaves((args, kwargs))
    )
