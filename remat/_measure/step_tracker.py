"""A `Tracker` for one training step that outlives the block that entered it (NOTE [ The first step ] in
remat/_budget/first_step.py): it forgets a step's new gradients, and stops counting before its mode can be popped."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._core.torch_compat import OpOverload
from . import resize
from .track import Tracker, _storage

__all__ = ["StepTracker"]


class StepTracker(Tracker):
    """A `Tracker` that can forget a storage and pause; the plain tracker's per-op path stays as it is."""

    def __init__(self) -> None:
        super().__init__()
        self._counting = True

    def _see(self, func: OpOverload, args: Sequence[Any], kwargs: dict[str, Any] | None, out: Any) -> None:
        if self._counting:
            super()._see(func, args, kwargs, out)

    def pause(self) -> None:
        """Count nothing more (the numbers stay as they are) while the mode waits to be popped on its own thread."""
        self._counting = False
        resize.unwatch(self)
        with self._lock:
            self._live.clear()

    def forget(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage no more, as if it had been live before the block (a step's new gradients)."""
        st = _storage(tensor)
        if st is None:
            return
        with self._lock:
            entry = self._live.pop(st._cdata, None)  # dropping the weak reference drops its callback
            if entry is not None:
                self._account(entry[0], -entry[1])
