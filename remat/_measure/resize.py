"""Storage resizes for the byte trackers: ``untyped_storage().resize_(n)`` seen while a tracker is open.

NOTE [ Resized storages ]
FSDP2 (``fully_shard``) frees a module's unsharded parameters after forward and backward with
``tensor.untyped_storage().resize_(0)``, and allocates them again before the next all-gather with a resize up
(torch's ``free_storage``/``alloc_storage``; FSDP1 does the same through ``TypedStorage._resize_``, which calls
the untyped one). That call goes straight to the allocator, not through the dispatcher: no
``TorchDispatchMode`` sees it, on CPU, on accelerators or for fake tensors. So while at least one tracker is open,
``torch.UntypedStorage.resize_`` is wrapped (the Python class's attribute, which every storage's method lookup
finds first; the C method it inherits stays as it was) and each open tracker is told the storage's bytes before
and after; before a storage grows, each is told the size asked for, and a tracker with a limit may refuse it
there (NOTE [ A device's limit ] in track.py). The wrapper is installed when the first tracker opens and
removed when the last one closes, so outside a tracker nothing changes. A resize in any thread counts, as a
release by another thread does.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from .._core.torch_compat import storage_resize

__all__ = ["Watcher", "unwatch", "watch"]


class Watcher(Protocol):
    """What a tracker offers to be told of resizes."""

    def _resizing(self, storage: torch.UntypedStorage, old: int, new: int) -> None: ...

    def _resized(self, storage: torch.UntypedStorage, old: int, new: int) -> None: ...


_LOCK = threading.Lock()
_WATCHERS: list[Watcher] = []
_ORIGINAL = storage_resize  # the C method `torch.UntypedStorage` inherits


def _resize(self: torch.UntypedStorage, size: int) -> Any:
    old = self.nbytes()
    if isinstance(size, int) and size > old:
        for watcher in list(_WATCHERS):
            watcher._resizing(self, old, size)  # may raise torch.OutOfMemoryError: the storage stays as it was
    out = _ORIGINAL(self, size)
    new = self.nbytes()
    if new != old:
        for watcher in list(_WATCHERS):
            watcher._resized(self, old, new)
    return out


def watch(watcher: Watcher) -> None:
    """Tell ``watcher`` of every storage resize from now until `unwatch`."""
    with _LOCK:
        if not _WATCHERS:
            torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign,assignment]
        _WATCHERS.append(watcher)


def unwatch(watcher: Watcher) -> None:
    """Stop telling ``watcher``; the last one out puts torch's method back."""
    with _LOCK:
        if watcher in _WATCHERS:
            _WATCHERS.remove(watcher)
        if not _WATCHERS and "resize_" in torch.UntypedStorage.__dict__:
            del torch.UntypedStorage.resize_
