"""`remat.apply(model, memory=..., sample=..., optimizer=...)`: plan activations in what the device has left.

NOTE [ Total memory ]
1. `memory=` bounds the device peak: the parameters, buffers, batch and optimizer state (counted exactly by
   `remat.estimate` on fake tensors), the gradients, the activations and the optimizer step's temporaries.
2. The budget handed to the budget's driver (remat/_budget/driver.py) is `memory` less that state and less the
   allocator's headroom (NOTE [ The allocator's reserve ] in remat/_estimate/reserve.py, which also has the check of
   the plan's real step against what the allocator reserved).
3. Unlike a plain budget, it counts the gradients: the plan's verified step (NOTE [ Verifying the plan ] in
   remat/_budget/verify.py) starts without them, as after `zero_grad()`, and a plan over it is corrected as for
   any budget, but without the budget's slack: a step over what the state leaves is refused, and the head, tiles
   and offload still open are taken next.
4. Two refusals, both a `BudgetError` naming the least total that fits: the estimate of full remat of every block
   (with the head in chunks where only that fits and the head may be routed, and the blocks' token-wise modules in
   tiles where only that fits and the request leaves tiles to the plan: NOTE [ Tiles as a choice ] in
   remat/_budget/tiles_choice.py) does not fit in `memory` less the headroom; or the planner finds no plan in the
   remainder (the least total is then the state plus the least budget it names, plus the headroom). The least
   total named is the least `memory` whose headroom leaves that (`least_memory`): `memory=` set to it does not
   fall short by its own headroom.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from .._budget.driver import fit_budget
from .._budget.offload_choice import offload_lowers_peak
from .._core.errors import BudgetError
from .._core.requests import MemoryRequest
from .._core.units import format_bytes
from .._engine.offload import resolve
from .._estimate.estimate import estimate
from .._estimate.long_sequences import HEAD, OFFLOAD, TILES_SUFFIX
from .._estimate.phases import OPTIMIZER
from .._estimate.predict import OptimizerLike
from .._estimate.report import ConfigEstimate
from .._estimate.reserve import SEGMENT, STEP, TRIES, caches, headroom_bytes, least_memory, reserved_peak
from .._measure.loss import default_loss
from .._measure.sample import as_call
from .._measure.step_autocast import StepAutocast, planning, step_region
from .._measure.track import placed
from .._sites.asked import carried, head_asked, tiles_asked
from .._sites.head import can_route_head
from .._sites.integrations import engine_of

__all__ = ["apply_memory", "as_optimizer"]

_log = logging.getLogger("remat")
_M = TypeVar("_M", bound=nn.Module)


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


def apply_memory(model: _M, request: MemoryRequest) -> _M:
    """See `remat.apply`, NOTE [ Total memory ] and NOTE [ The allocator's reserve ] in remat/_estimate/reserve.py:
    the blocks' token-wise modules tiled and the head routed where the request asks (remat/_sites/asked.py), then
    the budget's driver in its `MemoryRegime`, for what the step's state leaves (`_fit_memory`); nothing is left
    half done where it raises."""
    with tiles_asked(model, request), head_asked(model, request):
        return _fit_memory(model, request)


def _fit_memory(model: _M, request: MemoryRequest) -> _M:
    """`apply_memory` with what the request asks of the model already on it."""
    total, sample, loss, optimizer = request.memory, request.sample, request.loss, request.optimizer
    devices = placed(model)
    device = devices[0] if devices else torch.device("cpu")
    room = headroom_bytes(request.headroom, total, device)
    usable = total - room  # for the allocated peak: the rest is the allocator's
    row = _least(model, request, usable, device)
    # an engine's own buffers too (DeepSpeed ZeRO): a plan's first step sets them apart, as it does this state
    state = row.params_bytes + row.buffers_bytes + row.input_bytes + row.optimizer_bytes + row.engine_bytes
    if row.peak_bytes > usable:
        raise _refused(total, least_memory(row.peak_bytes, request.headroom, device), state, row.peak_phase, room)
    reserved: tuple[int, int] | None = None
    # no real step of remat's under an engine (NOTE [ Budgets under DeepSpeed ZeRO ], rule 4)
    verified = caches(device) and request.strategy == "rerun" and not request.compile and engine_of(model) is None
    target = total - room  # the allocated peak to plan for
    for attempt in range(TRIES + 1 if verified else 1):
        try:
            fit_budget(model, request, target - state)
        except BudgetError as error:  # the least that fits, with the shortfalls of earlier tries (`usable - target`)
            least = least_memory(max(row.peak_bytes, state + (error.least_bytes or 0)) + usable - target,
                                 request.headroom, device)
            raise _refused(total, least, state, "", total - target) from error
        if not verified:
            return model
        reserved = _reserved(model, device, sample, loss, optimizer, row)
        if reserved is not None and reserved[0] <= total:
            return model
        # below what that step allocated, by what it went over and a step more each time: NOTE [ The allocator's
        # reserve ], rule 2
        step = max(SEGMENT, math.ceil(STEP * total)) << attempt
        target = (min(target, reserved[1]) - (reserved[0] - total) if reserved is not None else target) - step
        if row.peak_bytes > target:  # below full remat's own peak: no plan holds less
            break
        _log.warning("remat: the plan for memory=%s %s in a real step; planning again for %s allocated.",
                     format_bytes(total), f"reserved {format_bytes(reserved[0])} on {device}" if reserved is not None
                     else f"ran out of memory on {device}", format_bytes(target))
    least = least_memory(row.peak_bytes + usable - target, request.headroom, device)  # with the last shortfall
    if reserved is not None:  # at most what the last plan reserved (a segment's rounding can outweigh the rest)
        least = min(least, reserved[0])
    raise BudgetError(
        f"remat: a training step does not fit in memory={format_bytes(total)} on {device}: "
        f"{'the plan that holds least still ' if row.peak_bytes <= target else 'the last plan '}"
        f"{'reserved ' + format_bytes(reserved[0]) if reserved is not None else 'ran out of memory'} in a real "
        f"step, and full remat of every block has a device peak of {format_bytes(row.peak_bytes)} (what the "
        "allocator reserves "
        "above what tensors take counts: NOTE [ The allocator's reserve ]). Give more memory, a smaller batch, or "
        "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to waste less.",
        least_bytes=max(total + 1, least),
    )


def _least(model: nn.Module, request: MemoryRequest, total: int, device: torch.device) -> ConfigEstimate:
    """The estimate of full remat of every block (what it keeps on the host where `offload=True` asks that on an
    accelerator); where that does not fit in `total`, with what the request leaves to the plan added in the plan's
    order until it fits: the head in chunks where it may be routed (NOTE [ The head as a choice ] in
    remat/_budget/head_choice.py), the blocks' token-wise modules in tiles in eager code (NOTE [ Tiles as a
    choice ] in remat/_budget/tiles_choice.py), and on an accelerator, in eager code, what the blocks keep on the
    host (NOTE [ Offload as a choice ] in remat/_budget/offload_choice.py)."""
    optimizer = as_optimizer(request.optimizer)
    offloads = offload_lowers_peak((device,), request.compile)
    config = "full" + _suffixes(model) + (OFFLOAD if offloads and resolve(request.offload) is not None else "")
    row = estimate(model, request.sample, loss=request.loss, optimizer=optimizer, configs=(config,),
                   where=request.where)[config]
    for suffix, open_ in ((HEAD, request.head is None and can_route_head(model)),
                          (TILES_SUFFIX, request.tiles is None and not request.compile),
                          (OFFLOAD, request.offload is None and offloads)):
        if row.peak_bytes > total and open_ and suffix not in config:
            config += suffix
            row = estimate(model, request.sample, loss=request.loss, optimizer=optimizer, configs=(config,),
                           where=request.where)[config]
    return row


def _suffixes(model: nn.Module) -> str:
    """The configuration's suffixes for what the model `carried`: an estimate's row is of the model as it was
    before remat (NOTE [ Applying a configuration for a while ]), so they are named."""
    head, tiles = carried(model)
    return (HEAD if head else "") + (f"{TILES_SUFFIX}={tiles}" if tiles is not None else "")


def _reserved(model: nn.Module, device: torch.device, sample: Any, loss: Callable[[Any], Any] | None,
              optimizer: Any, row: ConfigEstimate) -> tuple[int, int] | None:
    """What the allocator reserves through one real step of the plan, the optimizer's state and its step's
    temporaries stood in for: NOTE [ The allocator's reserve ], rule 2."""
    existing = 0
    if isinstance(optimizer, torch.optim.Optimizer):
        existing = sum(t.untyped_storage().nbytes() for state in optimizer.state.values() for t in state.values()
                       if isinstance(t, torch.Tensor) and t.device == device)
    missing = max(0, row.optimizer_bytes - existing)
    resident = row.params_bytes + row.buffers_bytes + row.input_bytes + row.optimizer_bytes + row.grads_bytes
    temporaries = max(0, row.phase_bytes.get(OPTIMIZER, 0) - resident)
    args, kwargs = as_call(sample)
    autocast = StepAutocast.caller((device,))
    scalar = loss or default_loss

    def forward() -> torch.Tensor:
        with step_region(autocast):
            value: torch.Tensor = scalar(model(*args, **kwargs))
        return value

    with torch.enable_grad(), planning(autocast, (device,)):
        return reserved_peak(model, device, forward, missing, temporaries)


def _refused(total: int, least: int, state: int, phase: str, room: int = 0) -> BudgetError:
    where = f" (the step peaks in {phase} there)" if phase else ""
    reserve = (f", and {format_bytes(room)} left to the allocator (`headroom=`: NOTE [ The allocator's reserve ])"
               if room else "")
    return BudgetError(
        f"remat: a training step does not fit in memory={format_bytes(total)} even with full remat of every block: "
        f"its device peak is at least {format_bytes(least)}{where}, of which {format_bytes(state)} are parameters, "
        "buffers, "
        f"the batch and the optimizer's state{reserve}. Give more memory, a smaller batch, or a leaner optimizer.",
        least_bytes=least,
    )
