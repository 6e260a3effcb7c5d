"""How remat calls a model on a sample and turns its output into the loss: one rule, used everywhere.

`remat.apply(budget=...)`, `remat.measure`, `remat.estimate` and the benchmark all call `call_model(model, sample)`
and, without a `loss=`, `default_loss(output)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._core.torch_compat import tree_leaves

__all__ = ["call_model", "default_loss"]


def call_model(model: nn.Module, sample: Any) -> Any:
    """`model` on `sample`: a dict is keyword arguments, a tuple or list positional ones, anything else the one input.

    >>> call_model(nn.Identity(), (torch.ones(1),))
    tensor([1.])
    """
    if isinstance(sample, Mapping):
        return model(**sample)
    if isinstance(sample, (tuple, list)):
        return model(*sample)
    return model(sample)


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a model's `output` when no `loss=` is given: its `.loss` if it has one, else the sum of its
    floating tensors (all of them, at any depth of tuples, lists and dicts).

    `loss=` elsewhere is a callable from the output to a scalar; this is what it defaults to. Callers that need
    the loss to require grad check that themselves.

    Raises:
        TypeError: the output has no `.loss` tensor and no floating tensor.

    >>> default_loss((torch.ones(2), torch.tensor([1, 2])))
    tensor(2.)
    """
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and not isinstance(output, dict):
        output = dict(output)  # a Mapping that pytree does not know (a model-output class): its values
    floats = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise TypeError(
            f"remat: the model's output (`{type(output).__name__}`) has no `.loss` and no floating tensor to make "
            "a loss from; pass `loss=` (a callable from the output to a scalar)."
        )
    total = floats[0].sum()
    for t in floats[1:]:
        total = total + t.sum()
    return total
