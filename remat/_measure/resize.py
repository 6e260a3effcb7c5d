"""Storage resizes for the byte trackers: ``untyped_storage().resize_(n)`` seen while a tracker is open.

NOTE [ Resized storages ]
FSDP2 (``fully_shard``) frees a module's unsharded parameters after forward and backward with
``tensor.untyped_storage().resize_(0)``, and allocates them again before the next all-gather with a resize up
(torch's ``free_storage``/``alloc_storage``; FSDP1 does the same through ``TypedStorage._resize_``, which calls
the untyped one). That call goes straight to the allocator, not through the dispatcher: no
``TorchDispatchMode`` sees it, on CPU, on accelerators or for fake tensors. So while at least one tracker is open,
``torch.UntypedStorage.resize_`` is wrapped (the Python class's attribute, which every storage's method lookup
finds first) and each open tracker is told the storage's bytes before and after; before a storage grows, each is
told the size asked for, and a tracker with a limit may refuse it there (NOTE [ A device's limit ] in track.py).
A resize in any thread counts, as a release by another thread does.

The wrapper changes the process, so it is there only while a tracker is open: installed when the first tracker
opens and taken out when the last one closes. It calls whatever ``resize_`` was before it (torch's C method, or
another library's own wrapper of it), and when it goes it puts back exactly that: the class's own attribute as
it was, or none. Should another library have wrapped it in turn meanwhile, theirs stays, and ours, still called
through theirs, only passes each call on.
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
