"""`remat.apply(model, ...)`: `drive` takes the request and makes one dispatch on its type to its driver (NOTE [ The
requests of remat.apply ] in remat/_core/requests.py):

* `BudgetRequest`: the budget's driver (`_budget/driver.apply_budget`), whose plan `remat.estimate` runs too;
* `MemoryRequest`: the memory's driver (`memory.apply_memory`), which sizes the step's state with the estimator and
  hands what is left to the budget's driver;
* `BlocksRequest`: every `every`-th block under one policy (`_sites/targets.apply_blocks`).

Each driver first puts on what the request asks of the model besides the blocks' policies (`tiles=N`, `head=True`:
remat/_sites/asked.py), so that a budget's profile runs the blocks tiled and the head routed, and takes it back
where it raises.
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

from torch import nn

from .._core.requests import BlocksRequest, BudgetRequest, MemoryRequest, Request
from .._sites import targets as _targets
from .._sites.asked import head_asked, tiles_asked
from .._sites.unreached import watch_blocks

__all__ = ["drive", "own_step_bytes"]

_M = TypeVar("_M", bound=nn.Module)


def drive(model: _M, request: Request) -> _M:
    """Apply `request` to `model` (see `remat.apply`): the one dispatch on the request's type to its driver; the
    planners load with the first request needing them. Nothing is left half done where it raises."""
    _check_model(model)
    if isinstance(request, BudgetRequest):
        from .._budget.driver import apply_budget

        return apply_budget(model, request, own_step_bytes)
    if isinstance(request, MemoryRequest):
        from .memory import apply_memory

        return apply_memory(model, request)
    if isinstance(request, BlocksRequest):
        with tiles_asked(model, request), head_asked(model, request):
            names = _targets.apply_blocks(model, request.where, request.every, request.options(request.policy))
        watch_blocks(model, names)  # NOTE [ Blocks that forward never calls ]
        return model
    raise TypeError(f"remat: apply takes a blocks, budget or memory request, but got `{type(request).__name__}`.")


def own_step_bytes(model: nn.Module, request: BudgetRequest) -> int:
    """The request's fractional budget in bytes: that fraction of the step's peak without remat with the model's own
    head, above the step's start (the state left out, as a budget counts it), estimated on fake tensors before the
    head is routed (NOTE [ The head as a choice ] in remat/_budget/head_choice.py, rule 2): the budget's driver calls
    it, with the blocks already tiled where the request asks."""
    from .._estimate.estimate import estimate

    row = estimate(model, request.sample, loss=request.loss, configs=("none",), where=request.where)["none"]
    return max(1, int(request.budget * (row.peak_bytes - row.params_bytes - row.buffers_bytes - row.input_bytes)))


def _check_model(model: Any) -> None:
    """A clear `TypeError` for anything but a module instance, pointing a function or a class to `@remat`."""
    if isinstance(model, nn.Module):
        return
    kind = type(model).__name__
    if inspect.isclass(model) and issubclass(model, nn.Module):
        hint = (f" It got the class `{model.__name__}`: decorate the class with `@remat` (every instance's forward "
                "is rematerialized), or pass an instance.")
    elif callable(model):
        hint = (" To rematerialize a function or a method, decorate it with `@remat` (or call `remat(function)`); "
                "`remat.apply` picks the blocks of a model.")
    else:
        hint = ""
    raise TypeError(f"remat: apply expects an nn.Module, but got `{kind}`.{hint}")
