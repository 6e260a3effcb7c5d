"""Offload what autograd keeps to host memory: `remat.offload()`, `offload=True` on sites.

See NOTE [ What is offloaded ] and NOTE [ Offloaded sites ] here, NOTE [ Offload lifecycle ] in transfer.py.
"""

from __future__ import annotations

import sys
import threading
import weakref
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._core.errors import RematError
from .._core.public import claim
from .._core.torch_compat import (
    disable_current_modes,
    dispatch_modes_on,
    pop_saved_hooks,
    push_saved_hooks,
    top_saved_hooks,
)
from .guard import storage_key
from .hooks import Frame
from .tape import Tape
from .transfer import Parcel, Stay, pack, reap

__all__ = ["Offload", "for_kept", "no_offload_inside", "offload", "resolve"]

# NOTE [ What is offloaded ]
# Rules:
# 1. A saved tensor is offloaded when it is on an accelerator (or on CPU with `include_cpu`), holds at least
#    `min_bytes` (and more than none), is a plain strided tensor, and is not memory that lives anyway: not an
#    `nn.Parameter`, not a leaf that requires grad (a user's input), not a view of one of those, and not a module
#    buffer.
# 2. What crosses is memory, not tensors (NOTE [ What crosses ] in transfer.py): a tensor saved twice (the output
#    of `tanh`, saved by `tanh` and by the matmul that reads it) and views of one storage (q, k and v split from
#    one projection) cross once, through one copy their parcels point into.
# 3. Everything else is handed back as it is (`Stay`), with its version, so an in-place change before backward
#    still raises; so does an offloaded tensor's, while the tensor lives.
# 4. Offload's own copies run with the dispatch modes set aside and without grad: a site's recorder or policy, or
#    `remat.track`, never sees them (the tracker counts device memory, `transfer.offloaded_bytes()` host copies).
#
# Implementation notes:
# 1. (rule 1) Buffers are recognised by storage: while an offload block is open, a global forward pre-hook
#    (torch's public `register_module_forward_pre_hook`, removed when the last block exits) notes the buffers of
#    every module called (a lookup of `module._buffers`; weak references, so nothing is kept alive). A buffer that
#    reaches a site's `offload=` outside any offload block is not recognised and is copied like an activation:
#    correct, one copy more.
# 2. (rule 2) `_shared`, per `Offload`, maps the id of a storage to its last copy, weakly; the copy holds the
#    storage weakly, to tell it from a later one at the same id.

_INSIDE_RERUN = (
    "remat: `with remat.offload():` inside the rematerialized function `{site}`: rerun calls the function again "
    "in backward and the offload block would take the tensors that recompute must rebuild. Give the site "
    "`offload=True` instead (what it keeps goes to host), or put the offload block around the call."
)


# -- buffers (NOTE [ What is offloaded ]) ------------------------------------------------------------------

_buffers: dict[int, weakref.ref[torch.Tensor]] = {}
_watch_lock = threading.Lock()
_watchers = 0  # open offload blocks, all threads: the hook is installed while there is one
_watch_handle: RemovableHandle | None = None


def _note_buffers(module: nn.Module, args: Any) -> None:
    if module._buffers and not torch.compiler.is_compiling():  # dynamo would break the graph on weakrefs
        for buffer in module._buffers.values():
            if buffer is not None:
                key = storage_key(buffer)
                if key is not None:
                    _buffers[key] = weakref.ref(buffer)


def _watch_buffers() -> None:
    global _watchers, _watch_handle
    with _watch_lock:
        _watchers += 1
        if _watch_handle is None:
            _watch_handle = nn.modules.module.register_module_forward_pre_hook(_note_buffers)


def _unwatch_buffers() -> None:
    global _watchers, _watch_handle
    with _watch_lock:
        _watchers -= 1
        if _watchers == 0 and _watch_handle is not None:
            _watch_handle.remove()
            _watch_handle = None


_HAND_OVER = frozenset({Frame.hand_over.__code__, Tape.hand_to.__code__})
"""Where a nested site hands a tensor to the enclosing pack hook (NOTE [ Inputs of nested sites ] in hooks.py): a
rerun frame, and a region's tape at the end of its forward. The block's pack hook, called from there, packs at a
site's pace."""

# The engine's seam for sites that push saved-tensor hooks of their own: a frame class registered here (rerun's)
# makes `with remat.offload():` raise when its pack hook is the innermost one (see `_INSIDE_RERUN`).
_no_offload_inside: list[type] = []


def no_offload_inside(frame_type: type) -> None:
    """Refuse an offload block whose innermost saved-tensor pack hook is a bound method of a `frame_type`."""
    _no_offload_inside.append(frame_type)


def _is_buffer(tensor: torch.Tensor) -> bool:
    key = storage_key(tensor)
    ref = _buffers.get(key) if key is not None else None
    if ref is None:
        return False
    buffer = ref()
    if buffer is None or storage_key(buffer) != key:
        _buffers.pop(key, None)  # type: ignore[arg-type]
        return False
    return True


def _lives_anyway(tensor: torch.Tensor) -> bool:
    """A parameter, a leaf that requires grad, a view of one of those."""
    if isinstance(tensor, nn.Parameter) or (tensor.requires_grad and tensor.is_leaf):
        return True
    base = tensor._base
    return base is not None and (isinstance(base, nn.Parameter) or (base.requires_grad and base.is_leaf))


class Offload:
    """Keep what autograd saves in host memory instead of on the accelerator.

    Made by `remat.offload(...)`. As a context manager, every tensor autograd saves inside the block that
    qualifies (see `remat.offload`) is copied to host memory in forward and brought back in backward. As a
    site option (`@remat(offload=remat.offload(...))`), it says how that site offloads what it keeps. One
    object may be entered again, nested and from several threads.

    >>> import torch, remat
    >>> x = torch.randn(64, 64, requires_grad=True)
    >>> with remat.offload(include_cpu=True):
    ...     y = x.exp().exp()
    >>> y.sum().backward()
    """

    def __init__(self, min_bytes: int = 1024, pin_memory: bool = True, include_cpu: bool = False) -> None:
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"remat: offload's `min_bytes` must be an int >= 0, but got {min_bytes!r}.")
        for flag, value in (("pin_memory", pin_memory), ("include_cpu", include_cpu)):
            if not isinstance(value, bool):
                raise TypeError(f"remat: offload's `{flag}` must be a bool, but got `{type(value).__name__}`.")
        self.min_bytes = min_bytes
        self.pin_memory = pin_memory
        self.include_cpu = include_cpu
        self._shared: dict[int, weakref.ref[Any]] = {}  # storage -> its last copy
        self._block_hooks = (self._pack_saved, self.unpack)  # what `with` pushes (NOTE [ Offload lifecycle ], rule 6)

    def __repr__(self) -> str:
        return (
            f"remat.offload(min_bytes={self.min_bytes}, pin_memory={self.pin_memory}, "
            f"include_cpu={self.include_cpu})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Only the settings: a module whose site offloads pickles and deep-copies.
        return (Offload, (self.min_bytes, self.pin_memory, self.include_cpu))

    @property
    def hooks(self) -> tuple[Any, Any]:
        """The saved-tensor hooks `(pack, unpack)` that offload."""
        return self.pack, self.unpack

    # -- the hooks -----------------------------------------------------------------------------------------
    def qualifies(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` would be copied to host (see NOTE [ What is offloaded ])."""
        device = tensor.device.type
        if device == "meta" or (device == "cpu" and not self.include_cpu):
            return False
        if type(tensor) is not torch.Tensor and type(tensor) is not nn.Parameter:
            return False  # tensor subclasses (fake, functional, DTensor) keep their own semantics
        if tensor.layout != torch.strided:
            return False
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or nbytes < self.min_bytes:
            return False
        return not _lives_anyway(tensor) and not (_buffers and _is_buffer(tensor))

    def pack(self, tensor: torch.Tensor) -> Parcel | Stay:
        """The pack hook of a site: a `Parcel` (a place in a host copy) for a qualifying tensor, a `Stay` for the
        rest. Its copies may stay in flight and come back ahead of their use (NOTE [ Offload lifecycle ], rule 6)."""
        return self._pack(tensor, True)

    def _pack_saved(self, tensor: torch.Tensor) -> Parcel | Stay:
        """The pack hook of the block (`with remat.offload():`): what autograd saves in it holds no device memory
        past its copy and comes back when asked; what a nested site hands over goes as `pack` (implementation
        note 6 of NOTE [ Offload lifecycle ] in transfer.py)."""
        return self._pack(tensor, sys._getframe(1).f_code in _HAND_OVER)

    def _pack(self, tensor: torch.Tensor, early: bool) -> Parcel | Stay:
        if not self.qualifies(tensor):
            return Stay(tensor)
        if dispatch_modes_on() or torch.is_grad_enabled():  # a site packing in forward: no op of ours recorded
            with disable_current_modes(), torch.no_grad():
                return pack(tensor, self.pin_memory, self._shared, early)
        return pack(tensor, self.pin_memory, self._shared, early)

    @staticmethod
    def unpack(packed: Parcel | Stay) -> torch.Tensor:
        """The unpack hook: the tensor back on its device."""
        return packed.get()

    @staticmethod
    def unpack_one(value: Any) -> Any:
        """An op output a policy kept, packed tensor by tensor (a tensor or a tuple/list of them), on its device."""
        if isinstance(value, (Parcel, Stay)):
            return value.get()
        if isinstance(value, (tuple, list)):
            return type(value)(t.get() if isinstance(t, (Parcel, Stay)) else t for t in value)
        return value

    # -- the context manager -------------------------------------------------------------------------------
    def __enter__(self) -> Offload:
        top = top_saved_hooks(False)
        if top is not None:
            frame = getattr(top[0], "__self__", None)
            if isinstance(frame, tuple(_no_offload_inside)):
                raise RematError(_INSIDE_RERUN.format(site=getattr(frame, "site", "?")))
        push_saved_hooks(*self._block_hooks)
        _watch_buffers()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        pop_saved_hooks()
        _unwatch_buffers()
        reap()


def offload(min_bytes: int = 1024, pin_memory: bool = True, include_cpu: bool = False) -> Offload:
    """Keep the tensors autograd saves in host memory, not on the accelerator: `with remat.offload():`.

    Every tensor autograd saves for backward inside the block that lives on an accelerator, holds at least
    `min_bytes`, and is not a parameter, a buffer, a leaf that requires grad or a view of one of those, is
    copied to host memory in forward, on a side stream of its device, and copied back in backward when its node
    needs it; the device holds what `torch.autograd.graph.save_on_cpu` would, and the host never waits. Wrap
    rematerialized sites in it, or give a site `offload=True`, and what those sites keep (their inputs, what
    a policy saves) goes to host while what they recompute is never copied; their copies overlap compute and
    come back ahead of their use (NOTE [ Offload lifecycle ], rule 6, in transfer.py). Device-generic (CUDA,
    XPU, ...: `torch.get_device_module`).

    Args:
        min_bytes: smaller tensors stay where they are (a copy costs more than it frees).
        pin_memory: copy into pinned host memory, so that copies run asynchronously.
        include_cpu: also copy CPU tensors (into separate host tensors, through the same path): for tests.
            Without it, offload is a pass-through on CPU, where there is nowhere cheaper to put them.

    Returns:
        An `Offload`: a context manager, also accepted as a site's `offload=` option.

    Raises:
        ValueError, TypeError: for a bad `min_bytes`, `pin_memory` or `include_cpu`.

    >>> import torch, remat
    >>> w = torch.randn(32, 32, requires_grad=True)
    >>> with remat.offload(include_cpu=True):
    ...     loss = (torch.randn(8, 32) @ w).tanh().sum()
    >>> loss.backward()
    """
    return Offload(min_bytes, pin_memory, include_cpu)


_default: list[Offload] = []


def resolve(setting: Any) -> Offload | None:
    """A site's `offload=` option as an `Offload` (True: the defaults), or None.

    >>> resolve(False) is None, resolve(True) is resolve(True)
    (True, True)
    """
    if setting is False or setting is None:
        return None
    if setting is True:
        if not _default:
            _default.append(Offload())
        return _default[0]
    if isinstance(setting, Offload):
        return setting
    raise TypeError(
        f"remat: `offload` must be True, False or remat.offload(...), but got `{type(setting).__name__}`."
    )


def for_kept(offload: Offload | None, policy: Any) -> Offload | None:
    """Where a site puts what its `policy` keeps: its own `offload`, else the default one for a policy that
    offloads (`policies.offload(...)`), else nowhere (None: kept on the device). See NOTE [ Offloaded sites ].

    >>> for_kept(None, None) is None
    True
    """
    if offload is not None or policy is None or not policy.offloads:
        return offload
    return resolve(True)


# NOTE [ Offloaded sites ]
# 1. A site with `offload=` (`@remat`, `remat(module)`, `remat.apply`, `remat.region`) keeps in host memory what it
#    keeps for backward: its inputs (and views of them), the outputs its policy saves, and parameters. What it
#    recomputes is never copied.
# 2. Inside another site its inputs are that site's activations, rebuilt by it: nothing is offloaded for them.
# 3. Kept outputs come back one by one as recompute reaches them.
#
# Implementation notes:
# 1. (rules 1, 2) Sites already hand their inputs to enclosing saved-tensor hooks (NOTE [ Inputs of nested sites ]
#    in hooks.py); an offloading site with none makes its `Offload` those hooks (`frame.outer`), so its inputs go to
#    host and come back through the same path.
# 2. (rule 3) The policy's outputs go to the frame's `offload` (the site's, or the default one for
#    `policies.offload(...)`): the pack hook returns their parcels, and the list recompute reuses holds parcels from
#    the end of forward on.

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
