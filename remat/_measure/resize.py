"""Storage resizes for the byte trackers: ``untyped_storage().resize_(n)`` seen while a tracker is open.

NOTE [ Resized storages ]
1. While at least one tracker is open, every ``torch.UntypedStorage.resize_`` (FSDP2's frees after forward and
   backward, its re-allocations before an all-gather; FSDP1's through ``TypedStorage._resize_``) is counted by every
   open tracker, in any thread: its bytes before and after; before a storage grows, the size asked for, which a
   tracker with a limit may refuse (NOTE [ A device's limit ] in track.py).
2. The process is changed only while a tracker is open: the wrapper is installed when the first opens and taken out
   when the last closes, putting back exactly what was there (torch's method, another library's wrapper, or no
   attribute of the class's own); if another library wrapped ours meanwhile, theirs stays and ours passes each call
   on.

Implementation notes:
1. (rule 1) The resize goes straight to the allocator, not through the dispatcher: no ``TorchDispatchMode`` sees it,
   on any device or for fake tensors. The wrapper is the Python class's attribute, which every storage's method
   lookup finds first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["Watcher", "unwatch", "watch"]


class Watcher(Protocol):
    """What a tracker offers to be told of resizes."""

    def _resizing(self, storage: torch.UntypedStorage, old: int, new: int) -> None: ...

    def _resized(self, storage: torch.UntypedStorage, old: int, new: int) -> None: ...


_Resize = Callable[[torch.UntypedStorage, int], Any]
_NONE = object()  # the class had no `resize_` of its own


class _Patch:
    """One installation of the wrapper: what it calls, what it replaced, and whether it still tells the watchers."""

    def __init__(self) -> None:
        self.previous: _Resize = torch.UntypedStorage.resize_  # torch's C method, or another library's wrapper
        self.replaced: object = torch.UntypedStorage.__dict__.get("resize_", _NONE)
        self.on = True
        patch = self

        def resize_(self: torch.UntypedStorage, size: int) -> Any:
            if not patch.on:  # taken out while another library's wrapper still calls it
                return patch.previous(self, size)
            return _resize(patch.previous, self, size)

        self.wrapper = resize_

    def take_out(self) -> None:
        self.on = False
        if torch.UntypedStorage.__dict__.get("resize_") is self.wrapper:
            if self.replaced is _NONE:
                del torch.UntypedStorage.resize_
            else:
                torch.UntypedStorage.resize_ = self.replaced  # type: ignore[method-assign,assignment]


_LOCK = threading.Lock()
_WATCHERS: list[Watcher] = []
_patch: _Patch | None = None  # the wrapper while a tracker is open


def _resize(previous: _Resize, self: torch.UntypedStorage, size: int) -> Any:
    old = self.nbytes()
    if isinstance(size, int) and size > old:
        for watcher in list(_WATCHERS):
            watcher._resizing(self, old, size)  # may raise torch.OutOfMemoryError: the storage stays as it was
    out = previous(self, size)
    new = self.nbytes()
    if new != old:
        for watcher in list(_WATCHERS):
            watcher._resized(self, old, new)
    return out


def watch(watcher: Watcher) -> None:
    """Tell ``watcher`` of every storage resize from now until `unwatch`."""
    global _patch
    with _LOCK:
        if _patch is None:
            _patch = _Patch()
            torch.UntypedStorage.resize_ = _patch.wrapper  # type: ignore[method-assign,assignment]
        _WATCHERS.append(watcher)


def unwatch(watcher: Watcher) -> None:
    """Stop telling ``watcher``; the last one out puts back what was there before the first."""
    global _patch
    with _LOCK:
        if watcher in _WATCHERS:
            _WATCHERS.remove(watcher)
        if not _WATCHERS and _patch is not None:
            _patch.take_out()
            _patch = None
