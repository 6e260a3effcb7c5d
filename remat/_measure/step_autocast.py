"""The autocast region of a training step, for the steps remat runs to plan and to predict.

NOTE [ A step's own autocast region ]
`torch.autocast` caches the low-precision casts of parameters (leaf tensors that require grad) for as long as its
outermost region lasts (``cache_enabled=True``, the default; `torch.clear_autocast_cache` runs when the nesting
count drops to zero). A real training loop opens a region around each step's forward and loss (torch's AMP
recipe; backward and the optimizer step run outside it), so every step casts its weights afresh and lets the casts
go when its forward ends. A profile or an estimate runs several steps in one call: inside the caller's region they
would share its cache, so the first step paid for the casts and the next ones did not, and every step kept them
through backward.

Rules:
1. The steps remat runs for a budget's profile and checks (remat/_budget/driver.py) and for each configuration of
   an estimate (remat/_estimate/predict.py) run as a real step does: forward and loss in a region of their own
   (`step_region`) with the caller's autocast settings (`StepAutocast.caller`: each enabled device type's dtype,
   and the cache switch), nothing cached before it and nothing after; backward and the optimizer step outside any
   autocast (`planning`).
2. While remat plans (`planning`), autocast is off on the thread and outside every region, as a real loop's
   backward is: the caller's regions are left (their nesting count taken down to zero, and put back after), so a
   step's region is the outermost one again and torch clears its cache when it ends, and a recompute in backward
   (which re-enters the forward's autocast: remat/_engine/autocast.py) casts and lets go as in a real backward.
   `step_region` also clears the cache when it starts: the caller's cached casts would otherwise be reused by a
   step on the same parameters (autocast casts again where they are needed; only their bytes change).
3. The settings a step runs under are the ones `planning` was given: a planner nested in another (the budget row
   of an estimate) reads them from there.
4. The settings are part of a plan: a budget planned under one autocast state and trained under another is
   planned again (remat/_budget/driver.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from .._core.torch_compat import any_autocast

__all__ = ["StepAutocast", "cached_cast", "planning", "step_region"]


@dataclass(frozen=True)
class StepAutocast:
    """The autocast settings a training step's forward runs under: the enabled device types with their dtypes, and
    whether casts are cached. Two equal values run the same step.

    >>> StepAutocast.caller(()) is None  # autocast off: the common case
    True
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     StepAutocast.caller(())
    StepAutocast(kinds=(('cpu', torch.bfloat16),), cache=True)
    """

    kinds: tuple[tuple[str, torch.dtype], ...]
    cache: bool

    @staticmethod
    def caller(devices: Iterable[torch.device | str]) -> StepAutocast | None:
        """The settings of the caller's autocast for the CPU and the types of ``devices`` (None: autocast off), or
        those `planning` was given when remat plans (NOTE [ A step's own autocast region ], rule 3)."""
        if _planned.stack:
            return _planned.stack[-1]
        if not any_autocast():
            return None
        types = sorted({"cpu", *(torch.device(device).type for device in devices)} - {"meta"})
        kinds = tuple((kind, torch.get_autocast_dtype(kind)) for kind in types if torch.is_autocast_enabled(kind))
        return StepAutocast(kinds, torch.is_autocast_cache_enabled()) if kinds else None

    def moved(self, kind: str, to: str) -> StepAutocast:
        """These settings with device type ``kind``'s moved to ``to`` (a device standing in for another), which
        then takes them over its own."""
        kinds = dict(self.kinds)
        if kind in kinds:
            kinds[to] = kinds.pop(kind)
        return StepAutocast(tuple(sorted(kinds.items())), self.cache)

    def __str__(self) -> str:
        kinds = ", ".join(f"{kind} {str(dtype).removeprefix('torch.')}" for kind, dtype in self.kinds)
        return f"autocast ({kinds}{'' if self.cache else ', no cache'})"


class _Planned(threading.local):
    stack: list[StepAutocast | None]

    def __init__(self) -> None:
        self.stack = []


_planned = _Planned()


@contextlib.contextmanager
def _settings(kinds: Iterable[tuple[str, bool, torch.dtype]], cache: bool) -> Iterator[None]:
    """Set autocast on or off with a dtype per device type, and the cache switch; put back as they were."""
    saved = [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind, _, _ in kinds]
    saved_cache = torch.is_autocast_cache_enabled()
    try:
        for kind, enabled, dtype in kinds:
            torch.set_autocast_enabled(kind, enabled)
            torch.set_autocast_dtype(kind, dtype)
        torch.set_autocast_cache_enabled(cache)
        yield
    finally:
        for kind, enabled, dtype in saved:
            torch.set_autocast_enabled(kind, enabled)
            torch.set_autocast_dtype(kind, dtype)
        torch.set_autocast_cache_enabled(saved_cache)


@contextlib.contextmanager
def _outside_regions() -> Iterator[None]:
    """Leave the caller's autocast regions for a while: their nesting count (torch's) down to zero, then back."""
    depth = torch.autocast_increment_nesting() - 1  # the count, read by moving it
    for _ in range(depth + 1):
        torch.autocast_decrement_nesting()
    try:
        yield
    finally:
        for _ in range(depth):
            torch.autocast_increment_nesting()


@contextlib.contextmanager
def planning(state: StepAutocast | None, devices: Iterable[torch.device | str] = ()) -> Iterator[None]:
    """Plan (profile, check, estimate) for steps whose forward runs under ``state``: outside every autocast region
    meanwhile, autocast off on the CPU, CUDA and the types of ``devices``, and ``state`` what `StepAutocast.caller`
    reads (NOTE [ A step's own autocast region ], rules 1 to 3)."""
    _planned.stack.append(state)
    try:
        if not any_autocast() and state is None:
            yield
            return
        types = {"cpu", "cuda", *(torch.device(device).type for device in devices),
                 *(kind for kind, _ in (state.kinds if state is not None else ()))} - {"meta"}
        off = [(kind, False, torch.get_autocast_dtype(kind)) for kind in sorted(types)
               if torch.is_autocast_enabled(kind)]
        with _outside_regions(), _settings(off, torch.is_autocast_cache_enabled()):
            yield
    finally:
        _planned.stack.pop()


@contextlib.contextmanager
def step_region(state: StepAutocast | None) -> Iterator[None]:
    """Run a step's forward and loss in an autocast region of its own under ``state`` (NOTE [ A step's own
    autocast region ]): torch's region, entered with the settings themselves (`torch.autocast` refuses a device
    type it finds unavailable); nothing where autocast is off."""
    if state is None:
        yield
        return
    torch.clear_autocast_cache()  # the caller's casts: rule 2
    torch.autocast_increment_nesting()
    try:
        with _settings([(kind, True, dtype) for kind, dtype in state.kinds], state.cache):
            yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()


def cached_cast(func: object, args: Sequence[object], kwargs: Mapping[str, object] | None) -> bool:
    """Whether an op that a planner's dispatch mode sees is autocast's cast of a parameter, which autocast caches
    for the step's region: a copy of a float32 leaf that requires grad into the autocast dtype of its device type,
    in a step planned under autocast with the cache on (torch's rule: ``cached_cast`` in
    aten/src/ATen/autocast_mode.cpp). Read from the planned settings: below autocast, torch says it is off."""
    state = _planned.stack[-1] if _planned.stack else None
    if state is None or not state.cache or func is not torch.ops.aten._to_copy.default or not args:
        return False
    source = args[0]
    if not isinstance(source, torch.Tensor) or source.dtype != torch.float32:
        return False
    if not (source.requires_grad and source.is_leaf and not source._is_view()):
        return False
    dtype = (kwargs or {}).get("dtype")
    return any(kind == source.device.type and dtype == low for kind, low in state.kinds)
