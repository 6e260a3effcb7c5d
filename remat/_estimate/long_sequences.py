"""The configurations that matter at long sequences, for `remat.estimate`: full remat with the chunked head, tiles and
per-block offload, written as suffixes ("full+head", "full+head+tiles", "full+head+tiles+offload").

See NOTE [ Long-sequence configurations ].
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._core.requests import TILES, Where
from .._engine.offload import Offload
from .._engine.transfer import prefetch
from .._measure.fake import counted_on
from .._sites import targets as _targets
from .._sites.head import route_head
from .._sites.tiles import tile_blocks, untile
from .predict import Configured

__all__ = ["EXTRAS", "HEAD", "TILES", "TILES_SUFFIX", "HostOffload", "split_extras", "with_extras"]

# NOTE [ Long-sequence configurations ]
# At long sequences full remat leaves three terms that grow with the sequence: the blocks' inputs it keeps, one
# block's internals while its backward runs, and the head. Each has a remedy that `remat.estimate` can price:
#
# Rules:
# 1. A configuration is a base ("full" or "save_matmuls") and suffixes, each at most once, in any order: "+head"
#    (the loss in chunks, as `remat.apply(model, head=True)`), "+tiles" or "+tiles=N" (the token-wise modules of the
#    blocks in N tiles, `TILES` by default: `remat.tiled`, NOTE [ What is tiled ]), "+offload" (per-block offload,
#    `remat.apply(model, offload=True)`: what each block keeps goes to host memory).
# 2. Per-block offload lowers the device's peak only on an accelerator: on the CPU, offload is a pass-through, and
#    so is its estimate.
# 3. The step runs on fake tensors, where remat's own offload (which copies real memory on side streams) does
#    nothing; so the estimate puts what a block keeps "on the host" by dropping the fake tensor and making a new one
#    on the device when backward asks for it (`HostOffload`), as a real offload brings memory back: once per
#    storage (every view of it shares the copy), held while a saved view of it lives and has unpacks left, and
#    brought back ahead by the real offload's walk, one block ahead (NOTE [ What crosses ] and NOTE [ Offload
#    lifecycle ] in remat/_engine/transfer.py).

HEAD = "+head"
"""The suffix of a configuration whose step also computes the loss in chunks (`remat.apply(model, head=True)`)."""


TILES_SUFFIX = "+tiles"
"""The suffix of a configuration whose blocks' token-wise modules run in `TILES` tiles."""

EXTRAS = ("head", "tiles", "offload")
"""The suffixes of rule 1."""


def split_extras(config: Any) -> tuple[Any, dict[str, int]]:
    """`(base, {suffix: value})` of a configuration (rule 1); the suffixes empty where it has none.

    >>> split_extras("full+head+tiles=4")
    ('full', {'head': 1, 'tiles': 4})
    >>> split_extras(0.3)
    (0.3, {})
    """
    if not isinstance(config, str) or "+" not in config:
        return config, {}
    base, *parts = config.split("+")
    extras: dict[str, int] = {}
    for part in parts:
        name, _, value = part.partition("=")
        if name not in EXTRAS or name in extras or (value and (name != "tiles" or not value.isdigit()
                                                                or int(value) < 1)):
            raise ValueError(
                f"remat: estimate does not know the configuration {config!r}: a base ('full', 'save_matmuls') and "
                "suffixes, each at most once: '+head' (the loss in chunks), '+tiles' or '+tiles=N' (the blocks' "
                "token-wise modules in tiles), '+offload' (what each block keeps on the host)."
            )
        extras[name] = int(value) if value else (TILES if name == "tiles" else 1)
    return base, extras


class HostOffload(Offload):
    """Offload on fake tensors (rule 3): a kept tensor that would go to host is dropped and made again on its device
    when backward first unpacks it, as remat's offload brings memory back (NOTE [ Offload lifecycle ] in
    remat/_engine/transfer.py): one copy per storage, held for all its unpacks, the copy made before it brought back
    ahead of its use."""

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


def with_extras(model: nn.Module, base: Configured, config: str, extras: dict[str, int],
                where: Where | None) -> Configured:
    """`base` (the base's sites, with `HostOffload` where "+offload" asks) with the head routed and the blocks'
    token-wise modules tiled for the step; checked now (a ValueError naming what was looked for)."""
    if "head" in extras:
        from .._sites.integrations.causal_lm import check

        check(model)
    blocks = _targets.select(model, where)  # no blocks: raised now

    @contextlib.contextmanager
    def applied(sample: Any) -> Iterator[None]:
        with base.apply(sample):  # it puts back the model's hooks and attributes, the head's among them
            if "head" in extras:
                route_head(model)
            tiled: list[str] = []
            if "tiles" in extras:
                tiled = list(tile_blocks(blocks, extras["tiles"]).tiled)
            try:
                yield
            finally:
                for name in tiled:
                    untile(model.get_submodule(name))

    return Configured(config, config, applied)
