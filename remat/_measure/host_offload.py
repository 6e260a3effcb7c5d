"""Offload on fake tensors: remat's offload as an estimate or a budget's profile on a fake twin sees it (NOTE [ Offload
on fake tensors ]).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .._engine.offload import Offload
from .._engine.transfer import prefetch
from .fake import counted_on

__all__ = ["HostOffload"]

# NOTE [ Offload on fake tensors ]
# On fake tensors remat's own offload (which copies real memory on side streams) does nothing: a fake tensor has no
# memory to copy. An estimate ("+offload", remat/_estimate/long_sequences.py) and a budget's profile on a fake twin
# (NOTE [ Offload as a choice ] in remat/_budget/offload_choice.py) still need the device's bytes as remat's offload
# leaves them.
#
# Rules:
# 1. What would go to the host is dropped: the fake tensor is not held, and a new one is made on its device when
#    backward first asks for it, as a real offload brings memory back.
# 2. Once per storage: every view of it shares the copy; the copy is held while a saved view of it lives and has
#    unpacks left (NOTE [ Offload lifecycle ] in remat/_engine/transfer.py).
# 3. Brought back ahead by the real offload's walk (`prefetch`), one block ahead (NOTE [ What crosses ] there).
# 4. What qualifies is what remat's offload takes, on the device the fake tensor counts on: not the CPU, not a
#    parameter or a leaf that needs its gradient, not below `min_bytes`.


class HostOffload(Offload):
    """Offload on fake tensors (NOTE [ Offload on fake tensors ]): a kept tensor that would go to host is dropped and
    made again on its device when backward first unpacks it, one copy per storage, held for all its unpacks, the copy
    made before it brought back ahead of its use."""

    def __init__(self) -> None:
        super().__init__()
        # weakly, as remat's offload holds its copies: a copy lives as long as a view of it (NOTE [ Offload
        # lifecycle ], rule 4), and what it brought back with it
        self._copies: dict[int, weakref.ref[_HostCopy]] = {}
        self._last: weakref.ref[_HostCopy] | None = None

    def qualifies(self, tensor: torch.Tensor) -> bool:
        device = counted_on(tensor.device)  # a CPU tensor standing in for CUDA is CUDA's: NOTE [ CUDA without a GPU ]
        if device.type in ("cpu", "meta") or tensor.layout != torch.strided or tensor.numel() == 0:
            return False
        if tensor.numel() * tensor.element_size() < self.min_bytes:
            return False
        base = tensor if tensor._base is None else tensor._base
        return not isinstance(base, nn.Parameter) and not (base.requires_grad and base.is_leaf)

    def pack(self, tensor: torch.Tensor) -> Any:
        if not self.qualifies(tensor):
            return _Stays(tensor)
        storage = tensor.untyped_storage()
        found = self._copies.get(id(storage))
        copy = None if found is None else found()
        if copy is None or copy.storage() is not storage or copy.dtype != tensor.dtype:  # views share a copy
            copy = _HostCopy(tensor, None if self._last is None else self._last())
            self._copies[id(storage)] = self._last = weakref.ref(copy)
        elif copy.later:  # packed again after later copies were made: it prefetches nothing
            copy.spread = True
        copy.users += 1
        return _HostView(copy, tensor)

    def unpack(self, packed: Any) -> torch.Tensor:  # type: ignore[override]
        return packed.take()  # type: ignore[no-any-return]


class _Stays:
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def take(self) -> torch.Tensor:
        return self.tensor


class _HostView:
    """One saved tensor in a `_HostCopy`: its view of the storage, as a parcel of remat's offload."""

    __slots__ = ("copy", "offset", "shape", "stride")

    def __init__(self, copy: _HostCopy, tensor: torch.Tensor) -> None:
        self.copy, self.shape, self.stride, self.offset = copy, tensor.shape, tensor.stride(), tensor.storage_offset()

    def take(self) -> torch.Tensor:
        return self.copy.take().as_strided(self.shape, self.stride, self.offset)


class _HostCopy:
    """A fake tensor's storage on the host, made again on its device for its unpacks (every view of it shares it),
    and brought back ahead as remat's offload brings a copy back (NOTE [ What crosses ], rule 2, and NOTE [ Offload
    lifecycle ], note 3, in remat/_engine/transfer.py)."""

    __slots__ = ("__weakref__", "device", "dtype", "fetched", "left", "next", "numel", "prev", "ready", "spread",
                 "storage", "users")
    early = True  # what sites keep: the pace that comes back ahead (NOTE [ Offload lifecycle ], rule 6)

    def __init__(self, tensor: torch.Tensor, prev: _HostCopy | None) -> None:
        self.dtype, self.device = tensor.dtype, tensor.device
        self.numel = tensor.untyped_storage().nbytes() // tensor.element_size()
        self.storage = weakref.ref(tensor.untyped_storage())
        self.prev = None if prev is None else weakref.ref(prev)
        self.next: weakref.ref[_HostCopy] | None = None
        self.spread = self.fetched = False
        if prev is not None:
            prev.next = weakref.ref(self)
        self.users = self.left = 0
        self.ready: torch.Tensor | None = None

    @property
    def later(self) -> bool:
        """Copies were made after this one (packed again now, it prefetches nothing)."""
        return self.next is not None

    def _bring(self) -> None:
        self.fetched = True
        if self.ready is None:
            self.ready = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self.left = self.users

    def take(self) -> torch.Tensor:
        self._bring()
        tensor = self.ready
        assert tensor is not None
        self.left -= 1
        if self.left <= 0:
            self.ready = None
        if not self.spread:  # the real offload's walk brings back what backward needs next
            prefetch(self, _brought, _unused, _HostCopy._bring)
        return tensor


def _brought(copy: _HostCopy) -> bool:
    return copy.fetched


def _unused(copy: _HostCopy) -> bool:
    return copy.ready is not None and copy.left == copy.users
