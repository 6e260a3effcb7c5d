"""`remat.apply(model, memory=..., sample=..., optimizer=...)`: plan activations in what the device has left.

NOTE [ Total memory ]
A device's memory holds, through a training step, the parameters, buffers, the batch and the optimizer's state
(alive from one step to the next), the gradients (made in backward, dropped by ``zero_grad``), the step's
activations, and the optimizer step's temporaries. `remat.estimate` counts the first ones exactly on fake
tensors; what is left, ``memory`` minus them, is the budget handed to `remat.apply(budget=...)`'s planner. A
plain budget leaves gradients out (its checked step runs with them already there); this one counts them, since
they take the same memory: the plan's checked step (NOTE [ Checking the plan ] in remat/_budget/check.py) starts
without gradients, as after ``zero_grad()``, so its measured peak is the activations, temporaries and the
gradients made so far, at backward's highest point, and a plan over it is corrected as for any budget. Two refusals,
both a `BudgetError` naming the least total that fits: the estimate of full remat of every block (which also
covers the optimizer step, whatever remat does) does not fit in ``memory``; or the planner finds no plan in the
remainder, when the least total is the state plus the least budget it names.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._budget.apply import apply_budget
from .._core.errors import BudgetError
from .._core.units import Budget, format_bytes, parse_memory
from .estimate import estimate
from .predict import OptimizerLike

__all__ = ["apply_memory", "as_optimizer"]


def as_optimizer(optimizer: Any) -> OptimizerLike:
    """What `estimate` takes for ``optimizer``: a name, a class or factory as they are; an optimizer object as a
    factory of the same class with the same settings (its ``defaults`` that its constructor takes)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer  # type: ignore[no-any-return]
    kind = type(optimizer)
    accepted = inspect.signature(kind).parameters
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}

    def same(params: Any) -> torch.optim.Optimizer:
        return kind(params, **defaults)

    return same


def apply_memory(model: nn.Module, memory: Budget, sample: Any, where: Any, *, optimizer: Any,
                 loss: Callable[[Any], Any] | None, options: dict[str, Any]) -> nn.Module:
    """See `remat.apply` and NOTE [ Total memory ]."""
    total = parse_memory(memory, "apply's `memory`")
    if sample is None:
        raise ValueError("remat: apply with `memory` needs `sample=`: the model's inputs for one training step (a "
                         "tensor, a tuple of positional arguments, or a dict of keyword arguments).")
    full = estimate(model, sample, loss=loss, optimizer=as_optimizer(optimizer), configs=("full",), where=where)
    row = full["full"]
    if row.peak_bytes > total and options.get("head") is None:  # NOTE [ The head as a choice ]
        from .head_budget import full_with_head

        row = full_with_head(model, sample, loss, as_optimizer(optimizer), where) or row
    state = row.params_bytes + row.buffers_bytes + row.input_bytes + row.optimizer_bytes
    if row.peak_bytes > total:
        raise _refused(total, row.peak_bytes, state, row.peak_phase)
    try:
        return apply_budget(model, total - state, sample, where, loss=loss, grads=True, **options)
    except BudgetError as error:
        raise _refused(total, max(row.peak_bytes, state + (error.least_bytes or 0)), state, "") from error


def _refused(total: int, least: int, state: int, phase: str) -> BudgetError:
    where = f" (the step peaks in {phase} there)" if phase else ""
    return BudgetError(
        f"remat: a training step does not fit in memory={format_bytes(total)} even with full remat of every block: "
        f"it needs at least {format_bytes(least)}{where}, of which {format_bytes(state)} are parameters, buffers, "
        "the batch and the optimizer's state. Give more memory, a smaller batch, or a leaner optimizer.",
        least_bytes=least,
    )
