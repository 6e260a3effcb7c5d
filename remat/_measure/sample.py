"""The sample a budget is planned on (`remat.apply(..., sample=...)`): as a call, detached, and its signature."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._core.torch_compat import tree_leaves, tree_map

__all__ = ["PLAN_FREE", "as_call", "detached", "signature"]


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


# NOTE [ Keywords a plan does not depend on ]
# 1. A training forward whose signature differs from the plan's is planned again (NOTE [ Budgeted models ] in
#    remat/_budget/driver.py), except for keywords known to change nothing a plan depends on: the Hugging Face
#    Trainer's `num_items_in_batch` (a count, an int or a one-element tensor, that only divides the loss).
# 2. An unknown keyword may change the step (transformers' `logits_to_keep` shrinks the head's logits), so it plans
#    again.
#
# Implementation notes:
# 1. (rule 1) Left out of the signature, the Trainer's first step runs the plan made on the sample (and is its check)
#    instead of planning again.
PLAN_FREE = frozenset({"num_items_in_batch"})
"""Keywords a step's memory does not depend on: left out of `signature`."""


def signature(args: Any, kwargs: Any) -> tuple[Any, ...]:
    """Shape, dtype and device of each tensor in a call: a forward with another signature is planned again
    (keywords of `PLAN_FREE` left out: NOTE [ Keywords a plan does not depend on ]).

    >>> import torch
    >>> x = torch.zeros(2, 3)
    >>> signature((x,), {}) == signature((x,), {"num_items_in_batch": torch.tensor(6)})
    True
    """
    if isinstance(kwargs, Mapping) and PLAN_FREE.intersection(kwargs):
        kwargs = {key: value for key, value in kwargs.items() if key not in PLAN_FREE}
    return tuple(
        (tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else None
        for t in tree_leaves((args, kwargs))
    )
