"""Autocast state of a region's forward, to re-enter it in recompute."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

from .._core.torch_compat import any_autocast

__all__ = ["AutocastState"]


class AutocastState:
    """Autocast settings of each device type a region touches, to re-enter them in recompute."""

    __slots__ = ("cache", "kinds")

    def __init__(self, devices: tuple[torch.device, ...]) -> None:
        kinds = {"cpu", *(device.type for device in devices)}
        self.kinds = tuple(
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in kinds
        )
        self.cache = torch.is_autocast_cache_enabled()

    def key(self) -> tuple[object, ...]:
        """What two states compare by: equal keys, the same autocast."""
        return (tuple(sorted(self.kinds, key=lambda kind: kind[0])), self.cache)

    @staticmethod
    @contextmanager
    def kept_casts(state: AutocastState | None) -> Iterator[None]:
        """Autocast's casts of the weights kept from one re-entry of `state` to the next while inside: autocast
        drops its cache when the outermost region exits, so each region that `enter` opens in here casts them
        again unless a region stays open around them all. That region re-enters the settings in force, so what
        runs in here outside those regions (a backward) runs as it would outside it."""
        if state is None or not state.cache:
            yield
            return
        with ExitStack() as stack:
            for kind, _, _ in state.kinds:
                stack.enter_context(torch.autocast(kind, dtype=torch.get_autocast_dtype(kind),
                                                   enabled=torch.is_autocast_enabled(kind),
                                                   cache_enabled=torch.is_autocast_cache_enabled()))
            yield

    @staticmethod
    def capture(devices: tuple[torch.device, ...]) -> AutocastState | None:
        """The current autocast state, or None when autocast is off everywhere (the common case)."""
        return AutocastState(devices) if any_autocast() else None

    @staticmethod
    @contextmanager
    def enter(state: AutocastState | None, devices: tuple[torch.device, ...]) -> Iterator[None]:
        """Re-enter `state`; with None, turn off any autocast the backward runs under."""
        if state is None:
            if not any_autocast():
                yield
                return
            state = AutocastState(devices)
            state.kinds = tuple((kind, False, dtype) for kind, _, dtype in state.kinds)
        with ExitStack() as stack:
            for kind, enabled, dtype in state.kinds:
                stack.enter_context(
                    torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=state.cache)
                )
            yield
