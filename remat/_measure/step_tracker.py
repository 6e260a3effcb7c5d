"""A `Tracker` for one training step that outlives the block that started it (NOTE [ The first step ] in
remat/_budget/first_step.py): it counts under its own mode or riding on the user's tracker (NOTE [ Riders ] in
track.py), stops counting before its mode can be popped, and sets apart what an engine allocates for itself
(NOTE [ Set apart ])."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._core.torch_compat import OpOverload
from . import resize
from .track import Tracker

__all__ = ["StepTracker"]

# NOTE [ Set apart ]
# An engine that owns a model's parameters and gradients (DeepSpeed ZeRO) allocates memory of its own inside a
# training step: gradient buckets and partitions, parameters it gathers for the modules that run. That memory is
# the engine's state, as the optimizer's is, not the activations and gradients a budget bounds.
# 1. A `StepTracker` given `set_apart` asks it at every new storage whether the op that made it is the engine's own;
#    such a storage is counted apart (`apart_bytes`, `apart_peak`) until it is released, never in the step's
#    numbers.
# 2. What decides is the code that allocates (the engine's integration knows it: remat/_sites/integrations), never
#    the storage's size or when it was made.


class StepTracker(Tracker):
    """A `Tracker` that can pause, and ride on another; the plain tracker's per-op path stays as it is.

    Attributes:
        on_host_exit: called when the tracker it rides on ends its block.
        apart_bytes: bytes live now of the storages set apart (NOTE [ Set apart ]).
        apart_peak: the most of them live at once.
    """

    def __init__(self, set_apart: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self._counting = True
        self.on_host_exit: Callable[[], None] | None = None
        self._set_apart = set_apart
        self._apart: dict[int, tuple[int, weakref.ref[torch.UntypedStorage]]] = {}
        self.apart_bytes = 0
        self.apart_peak = 0

    def _see(self, func: OpOverload, args: Sequence[Any], kwargs: dict[str, Any] | None, out: Any) -> None:
        if self._counting:
            super()._see(func, args, kwargs, out)

    def _add(self, key: int, t: torch.Tensor, st: torch.UntypedStorage) -> None:
        if self._set_apart is None or key in self._apart or not self._set_apart():
            if key not in self._apart:
                super()._add(key, t, st)
            return
        nbytes = self._place(t, st)[1]
        ref = weakref.ref(st, functools.partial(self._release_apart, key))
        with self._lock:
            self._apart[key] = (nbytes, ref)
            self.apart_bytes += nbytes
            self.apart_peak = max(self.apart_peak, self.apart_bytes)

    def _release_apart(self, key: int, ref: object = None) -> None:
        with self._lock:
            entry = self._apart.pop(key, None)
            if entry is not None:
                self.apart_bytes -= entry[0]

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            with self._lock:
                self._apart.clear()  # dropping the weak references drops their callbacks

    def _host_exited(self) -> None:
        if self.on_host_exit is not None:
            self.on_host_exit()

    def pause(self) -> None:
        """Count nothing more (the numbers stay as they are) while the mode waits to be popped on its own thread."""
        self._counting = False
        resize.unwatch(self)
        with self._lock:
            self._live.clear()
            self._apart.clear()
