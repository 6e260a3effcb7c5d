"""`remat.apply(model, ...)`: `drive` takes the request and makes one dispatch on its type to its driver (NOTE [ The
requests of remat.apply ] in remat/_core/requests.py), with the head routed first where the request asks for it.

* `BudgetRequest`: the budget's driver (`_budget/driver.apply_budget`), which `remat.estimate` runs too;
* `MemoryRequest`: the memory's driver (`memory.apply_memory`), which sizes the step's state with the estimator and
  hands what is left to the budget's driver;
* `BlocksRequest`: every `every`-th block under one policy (`_sites/targets.apply_blocks`).

With `tiles=N` the token-wise modules of the blocks `where` selects are tiled first (`tile_blocks`), so that a
budget's profile runs them tiled, and untiled again where the driver raises.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar

from torch import nn

from .._core.requests import BlocksRequest, BudgetRequest, MemoryRequest, Request
from .._sites import targets as _targets
from .._sites.head import route_head, unroute_head
from .._sites.tiles import nothing_tiled, tile_blocks, untile

__all__ = ["drive", "own_step_bytes"]

_M = TypeVar("_M", bound=nn.Module)


def drive(model: _M, request: Request) -> _M:
    """Apply `request` to `model` (see `remat.apply`): the driver of the request's mode, with the head routed first
    where the request asks for it; nothing is left half done where it raises."""
    _check_model(model)
    tiled = _tile_first(model, request)
    try:
        if not request.head:
            return _dispatch(model, request)
        return _with_head(model, request)
    except BaseException:
        for name in tiled:
            untile(model.get_submodule(name))
        raise


def _tile_first(model: nn.Module, request: Request) -> tuple[str, ...]:
    """`tiles=N`: the token-wise modules of the blocks `where` selects, tiled in place (every selected block, also
    those `every` leaves out: tiles lower what a block holds, rematerialized or not); their names. A ValueError
    that says what was looked for where the blocks hold none."""
    count = request.tile_count
    if count is None:
        return ()
    blocks = _targets.select(model, request.where)
    report = tile_blocks(blocks, count)
    if not report.tiled:
        raise nothing_tiled(report, blocks)
    return report.tiled


def _dispatch(model: _M, request: Request) -> _M:
    """The one dispatch on the request's type to its driver; the planners load with the first request needing them."""
    if isinstance(request, BudgetRequest):
        from .._budget.driver import apply_budget

        return apply_budget(model, request, request.budget)
    if isinstance(request, MemoryRequest):
        from .memory import apply_memory

        return apply_memory(model, request)
    if isinstance(request, BlocksRequest):
        return _targets.apply_blocks(model, request.where, request.every, request.options(request.policy))
    raise TypeError(f"remat: apply takes a blocks, budget or memory request, but got `{type(request).__name__}`.")


def _with_head(model: _M, request: Request) -> _M:
    """`head=True`: the head routed before the blocks (a budget's profile runs the step with it), a fractional budget
    turned into bytes of the step with the model's own head first (NOTE [ The head as a choice ] in
    remat/_budget/head_choice.py, rule 2), and the head put back where the driver raises."""
    if isinstance(request, BudgetRequest) and isinstance(request.budget, float):
        request = dataclasses.replace(request, budget=own_step_bytes(model, request))
    route_head(model)
    try:
        return _dispatch(model, request)
    except BaseException:
        unroute_head(model)
        raise


def own_step_bytes(model: nn.Module, request: BudgetRequest) -> int:
    """The request's fractional budget in bytes: that fraction of the step's peak without remat with the model's own
    head, above the step's start (the state left out, as a budget counts it), estimated on fake tensors before the
    head is routed (NOTE [ The head as a choice ] in remat/_budget/head_choice.py, rule 2)."""
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
