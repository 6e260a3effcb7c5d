"""A `Tracker` for one training step that outlives the block that started it (NOTE [ The first step ] in
remat/_budget/first_step.py): it counts under its own mode or riding on the user's tracker (NOTE [ Riders ] in
track.py), and stops counting before its mode can be popped."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._core.torch_compat import OpOverload
from . import resize
from .track import Tracker

__all__ = ["StepTracker"]


class StepTracker(Tracker):
    """A `Tracker` that can pause, and ride on another; the plain tracker's per-op path stays as it is.

    Attributes:
        on_host_exit: called when the tracker it rides on ends its block.
    """

    def __init__(self) -> None:
        super().__init__()
        self._counting = True
        self.on_host_exit: Callable[[], None] | None = None

    def _see(self, func: OpOverload, args: Sequence[Any], kwargs: dict[str, Any] | None, out: Any) -> None:
        if self._counting:
            super()._see(func, args, kwargs, out)

    def _host_exited(self) -> None:
        if self.on_host_exit is not None:
            self.on_host_exit()

    def pause(self) -> None:
        """Count nothing more (the numbers stay as they are) while the mode waits to be popped on its own thread."""
        self._counting = False
        resize.unwatch(self)
        with self._lock:
            self._live.clear()
