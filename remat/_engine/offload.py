"""Offload what autograd keeps to host memory: `remat.offload()`, `offload=True` on sites (spec §2.11).

See NOTE [ Offload lifecycle ], NOTE [ What is offloaded ] and NOTE [ Offloaded sites ].
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.utils._python_dispatch import _disable_current_modes

from .._errors import RematError
from .guard import storage_key

__all__ = ["Offload", "Parcel", "Stay", "host_bytes", "live_parcels", "offload", "reap", "resolve"]

# NOTE [ Offload lifecycle ]
# Forward (pack): a qualifying saved tensor is copied into a new host tensor (pinned when it comes from an
# accelerator and `pin_memory`) on the device's side stream, after that stream waited for the compute stream
# (which made the tensor); an event is recorded after the copy. The device tensor is not freed by us: its
# reference goes into the lane's `pending` queue with the event, and leaves it once the event has completed
# (`_Lane.reap`, polled without blocking on every pack and unpack, and by `reap()`), so the caching allocator
# can never hand its memory to a kernel while the copy still reads it. Nothing sleeps, nothing synchronizes
# the device. Autograd keeps a `Parcel` (the host copy) instead of the tensor.
# Backward (unpack): the parcel's tensor is copied back into a fresh device tensor (allocated on the compute
# stream, copied on the side stream after it waited for the compute stream, so memory the compute stream
# freed is not overwritten early), and the compute stream waits on that copy's event, not on the host.
# Prefetch: parcels are chained in the order they were packed (`prev`, a weak link, per thread and device);
# unpacking one starts copying back the `_AHEAD` nearest earlier ones that are still alive, since backward
# needs them next. A tensor brought back belongs to its graph task (two backwards over one graph never share
# one) and is held for as many unpacks as the parcel has users (a tensor saved by two nodes comes back once);
# a callback at the end of that backward drops whatever was brought back and not used.
# The host copy lives as long as the parcel, i.e. as long as autograd's saved variable: freed after the node
# ran, or when the graph is dropped; `retain_graph=True` keeps it for the next backward, which copies again.
# On CPU (`include_cpu=True`, for tests) the same functions run: torch.cpu's streams are no-ops and its
# events are None, so copies are synchronous and nothing is ever pending.
#
# NOTE [ What is offloaded ]
# A saved tensor is offloaded when it is on an accelerator (or on CPU with `include_cpu`), holds at least
# `min_bytes`, is a plain strided tensor, and is not memory that lives anyway: not an `nn.Parameter`, not a
# leaf that requires grad (a user's input), not a view of one of those, and not a module buffer. Buffers are
# recognised by storage: once an `Offload` exists, a global forward pre-hook notes the buffers of every module
# called (a lookup of `module._buffers`; weak references, so nothing is kept alive). A tensor saved twice
# (the output of `tanh`, saved by `tanh` and by the matmul that reads it) is the same Python object both
# times: it is copied once and both saved variables share the parcel. Everything else is handed back as it
# is (`Stay`), with its version, so an in-place change before backward still raises.
# Offload's own copies run with the dispatch modes set aside, so a site's recorder or policy, or
# `remat.track`, never sees them: the tracker counts device memory, `host_bytes()` counts host copies.

_AHEAD = 2  # parcels copied back ahead of the one being unpacked
_WALK = 8  # at most this many links followed when looking for them

_graph_task_id = torch._C._current_graph_task_id
_modes_on = torch._C._len_torch_dispatch_stack

_INPLACE = (
    "remat: one of the variables needed for gradient computation has been modified by an inplace "
    "operation: a tensor of shape {shape} saved under remat.offload was at version {before} when saved and is "
    "at version {after} now. Don't modify it in place between forward and backward (clone it first)."
)


class _Lane:
    """Copies between one device and host memory: a side stream on accelerators, plain copies on CPU."""

    __slots__ = ("device", "lock", "module", "pending", "stream")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        module: Any = torch.get_device_module(device.type)
        if device.type == "cpu" or not all(hasattr(module, name) for name in ("Stream", "current_stream", "stream")):
            # CPU, or a backend without streams (MPS): torch.cpu's no-op streams, synchronous copies
            self.module: Any = torch.cpu
            self.stream: Any = torch.cpu.Stream()
        else:
            self.module = module
            self.stream = module.Stream(device=device)
        self.pending: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self.lock = threading.Lock()

    def _compute(self) -> Any:
        return self.module.current_stream(self.device if self.module is not torch.cpu else None)

    def out(self, tensor: torch.Tensor, pin: bool) -> torch.Tensor:
        """Copy `tensor` into a new host tensor; its memory stays referenced until the copy is done."""
        pin = pin and self.device.type != "cpu"
        host = torch.empty_like(tensor, device="cpu", pin_memory=pin)
        self.stream.wait_stream(self._compute())
        with self.module.stream(self.stream):
            host.copy_(tensor, non_blocking=pin)
            event = self.stream.record_event()
        if event is not None:
            with self.lock:
                self.pending.append((event, tensor.detach()))
        return host

    def back(self, host: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
        """Start copying `host` into a new device tensor.

        Returns the tensor, the event that marks the end of the copy, and the stream the tensor was allocated
        on (the compute stream), which must wait on that event before the tensor is used or freed.
        """
        tensor = torch.empty_like(host, device=self.device)
        compute = self._compute()
        self.stream.wait_stream(compute)
        with self.module.stream(self.stream):
            tensor.copy_(host, non_blocking=host.is_pinned())
            event = self.stream.record_event()
        return tensor, event, compute

    def wait(self, event: Any, allocated: Any) -> None:
        """Make the compute stream (not the host) wait until the copy that recorded `event` is done."""
        if event is not None:
            compute = self._compute()
            compute.wait_event(event)
            if allocated != compute:
                allocated.wait_event(event)

    def reap(self) -> None:
        """Release the device tensors whose copy to host has finished (never blocks)."""
        pending = self.pending
        if not pending:
            return
        with self.lock:
            while pending and pending[0][0].query():
                pending.popleft()


_lanes: dict[torch.device, _Lane] = {}
_lanes_lock = threading.Lock()


def _lane(device: torch.device) -> _Lane:
    lane = _lanes.get(device)
    if lane is None:
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, torch.get_device_module(device.type).current_device())
        with _lanes_lock:
            lane = _lanes.get(device)
            if lane is None:
                lane = _lanes[device] = _Lane(device)
    return lane


def reap() -> None:
    """Release every device tensor whose copy to host has finished; never blocks.

    >>> reap()
    """
    for lane in list(_lanes.values()):
        lane.reap()


class _Counter:
    """Bytes of live host copies (for the benchmark and the tests)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current = 0
        self.peak = 0
        self.parcels = 0

    def add(self, nbytes: int, parcels: int) -> None:
        with self.lock:
            self.current += nbytes
            self.parcels += parcels
            self.peak = max(self.peak, self.current)


_counter = _Counter()


def host_bytes(reset_peak: bool = False) -> tuple[int, int]:
    """Bytes of host copies alive now, and the most alive at once since the last reset.

    >>> host_bytes(reset_peak=True)[0] >= 0
    True
    """
    with _counter.lock:
        current, peak = _counter.current, _counter.peak
        if reset_peak:
            _counter.peak = _counter.current
    return current, peak


def live_parcels() -> int:
    """How many offloaded tensors are held on the host right now.

    >>> live_parcels() >= 0
    True
    """
    return _counter.parcels


class _Chain(threading.local):
    """The last parcel packed on this thread, per device: see NOTE [ Offload lifecycle ], prefetch."""

    def __init__(self) -> None:
        self.last: dict[torch.device, weakref.ref[Parcel]] = {}


_chain = _Chain()


class Parcel:
    """What autograd keeps for an offloaded tensor: its host copy, and how to bring it back."""

    __slots__ = ("__weakref__", "host", "lane", "nbytes", "prev", "ready", "users")

    def __init__(self, tensor: torch.Tensor, pin: bool) -> None:
        lane = _lane(tensor.device)
        lane.reap()
        self.lane = lane
        self.host = lane.out(tensor, pin)
        self.nbytes = self.host.untyped_storage().nbytes()
        self.users = 0  # how many times pack handed it out: saved variables, a site's inputs
        # On its way back, for one backward: (graph task, tensor, event, stream it was allocated on, unpacks
        # still to come). A tensor dropped unused must first make that stream wait for its copy (`_let_go`),
        # or the allocator could hand its memory to a kernel while the copy still writes into it.
        self.ready: tuple[int, torch.Tensor, Any, Any, int] | None = None
        last = _chain.last
        self.prev = last.get(lane.device)
        last[lane.device] = weakref.ref(self)
        _counter.add(self.nbytes, 1)

    def __del__(self) -> None:
        if self.ready is not None:
            _let_go(self.ready)
        _counter.add(-self.nbytes, -1)

    def get(self) -> torch.Tensor:
        """The unpack: a device tensor with the saved values (prefetched, or copied back now).

        A parcel that several saved variables share comes back once per backward and stays until the
        last of them has been unpacked (or that backward ends), as the tensor itself would.
        """
        lane = self.lane
        lane.reap()
        gid = _graph_task_id()
        with _prefetch_lock:
            ready = self.ready
            if ready is not None and ready[0] == gid:
                _, tensor, event, allocated, left = ready
                self.ready = (gid, tensor, event, allocated, left - 1) if left > 1 else None
            else:
                ready = None
        if ready is None:
            tensor, event, allocated = lane.back(self.host)
            if gid != -1 and self.users > 1:
                self._hold(gid, tensor, event, allocated, self.users - 1)
        if gid != -1:
            self._prefetch_earlier(gid)
        lane.wait(event, allocated)
        return tensor

    def _hold(self, gid: int, tensor: torch.Tensor, event: Any, allocated: Any, left: int) -> None:
        """Keep a tensor brought back for `left` more unpacks in backward `gid` (dropped when it ends)."""
        with _prefetch_lock:
            if self.ready is not None:
                _let_go(self.ready)
            self.ready = (gid, tensor, event, allocated, left)
            waiting = _waiting.get(gid)
            if waiting is None:
                waiting = _waiting[gid] = []
                torch.autograd.Variable._execution_engine.queue_callback(lambda: _drop_ready(gid))
            waiting.append(weakref.ref(self))

    def _prefetch_earlier(self, gid: int) -> None:
        ahead = walked = 0
        link = self.prev
        while link is not None and ahead < _AHEAD and walked < _WALK:
            parcel = link()
            if parcel is None:
                return
            walked += 1
            link = parcel.prev
            ready = parcel.ready
            if ready is None or ready[0] != gid:
                parcel._hold(gid, *parcel.lane.back(parcel.host), parcel.users)
            ahead += 1


_prefetch_lock = threading.Lock()
_waiting: dict[int, list[weakref.ref[Parcel]]] = {}


def _drop_ready(gid: int) -> None:
    """End of a backward: forget what was brought back for it and not used (a node it did not run)."""
    with _prefetch_lock:
        for ref in _waiting.pop(gid, ()):
            parcel = ref()
            if parcel is not None and parcel.ready is not None and parcel.ready[0] == gid:
                _let_go(parcel.ready)
                parcel.ready = None


def _let_go(ready: tuple[int, torch.Tensor, Any, Any, int]) -> None:
    """Before a tensor brought back is dropped unused: its stream waits for the copy into it."""
    if ready[2] is not None:
        ready[3].wait_event(ready[2])


class Stay:
    """What autograd keeps for a saved tensor that is not offloaded: the tensor, and its version."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        # Not the tensor itself when it has a graph: an op may save its own output (a cycle through C++).
        self.tensor = tensor if tensor.is_leaf else tensor.detach()
        self.version = tensor._version

    def get(self) -> torch.Tensor:
        """The unpack: the tensor, after checking that it was not modified in place since."""
        tensor = self.tensor
        if tensor._version != self.version:
            raise RematError(
                _INPLACE.format(shape=list(tensor.shape), before=self.version, after=tensor._version)
            )
        return tensor


# -- buffers (NOTE [ What is offloaded ]) ------------------------------------------------------------------

_buffers: dict[int, weakref.ref[torch.Tensor]] = {}
_KEY = -0x0FF10AD
_watching = False
_watch_lock = threading.Lock()


def _note_buffers(module: nn.Module, args: Any) -> None:
    if module._buffers:
        for buffer in module._buffers.values():
            if buffer is not None:
                key = storage_key(buffer)
                if key is not None:
                    _buffers[key] = weakref.ref(buffer)


def _watch_buffers() -> None:
    global _watching
    with _watch_lock:
        if not _watching:
            _module._global_forward_pre_hooks[_KEY] = _note_buffers
            _watching = True


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
    """Keep what autograd saves in host memory instead of on the accelerator (spec §2.11).

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
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, weakref.ref[Parcel]]] = {}
        _watch_buffers()

    def __repr__(self) -> str:
        return (
            f"remat.offload(min_bytes={self.min_bytes}, pin_memory={self.pin_memory}, "
            f"include_cpu={self.include_cpu})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Only the settings: a module whose site offloads pickles and deep-copies (spec §2.1).
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
        if tensor.layout != torch.strided or tensor.numel() * tensor.element_size() < self.min_bytes:
            return False
        return not _lives_anyway(tensor) and not (_buffers and _is_buffer(tensor))

    def pack(self, tensor: torch.Tensor) -> Parcel | Stay:
        """The pack hook: a `Parcel` (a host copy) for a qualifying tensor, a `Stay` for the rest."""
        if not self.qualifies(tensor):
            return Stay(tensor)
        key = id(tensor)
        found = self._seen.get(key)
        if found is not None and found[0]() is tensor and found[1] == tensor._version:
            parcel = found[2]()
            if parcel is not None:
                parcel.users += 1
                return parcel
        if _modes_on():
            with _disable_current_modes():
                parcel = Parcel(tensor, self.pin_memory)
        else:
            parcel = Parcel(tensor, self.pin_memory)
        parcel.users = 1
        seen = self._seen
        if len(seen) > 4096:
            for stale in [k for k, (ref, _, box) in seen.items() if ref() is None or box() is None]:
                del seen[stale]
        seen[key] = (weakref.ref(tensor), tensor._version, weakref.ref(parcel))
        return parcel

    @staticmethod
    def unpack(packed: Parcel | Stay) -> torch.Tensor:
        """The unpack hook: the tensor back on its device."""
        return packed.get()

    def pack_all(self, values: Iterable[Any]) -> list[Any]:
        """Pack every tensor in a list of op outputs (a tensor, or a tuple/list of them)."""
        return [
            self.pack(value) if isinstance(value, torch.Tensor)
            else type(value)(self.pack(t) if isinstance(t, torch.Tensor) else t for t in value)
            if isinstance(value, (tuple, list)) else value
            for value in values
        ]

    @staticmethod
    def unpack_one(value: Any) -> Any:
        """The inverse of one item of `pack_all`."""
        if isinstance(value, (Parcel, Stay)):
            return value.get()
        if isinstance(value, (tuple, list)):
            return type(value)(t.get() if isinstance(t, (Parcel, Stay)) else t for t in value)
        return value

    # -- the context manager -------------------------------------------------------------------------------
    def __enter__(self) -> Offload:
        torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        reap()


def offload(min_bytes: int = 1024, pin_memory: bool = True, include_cpu: bool = False) -> Offload:
    """Keep the tensors autograd saves in host memory, not on the accelerator: `with remat.offload():`.

    Every tensor autograd saves for backward inside the block that lives on an accelerator, holds at least
    `min_bytes`, and is not a parameter, a buffer, a leaf that requires grad or a view of one of those, is
    copied to host memory in forward, on a side stream of its device (so the copy overlaps compute), and
    copied back in backward ahead of its use. The device tensor is freed once its copy is done. Wrap
    rematerialized sites in it, or give a site `offload=True`, and what those sites keep (their inputs, what
    a policy saves) goes to host while what they recompute is never copied. Device-generic (CUDA, XPU, ...:
    `torch.get_device_module`).

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


# NOTE [ Offloaded sites ]
# A site with `offload=` (`@remat`, `remat(module)`, `remat.apply`, `remat.region`) keeps for backward its
# inputs (and views of them), the outputs its policy saves, and parameters. Sites already hand their inputs
# to the enclosing saved-tensor hooks when there are any (NOTE [ Inputs of nested sites ] in hooks.py);
# an offloading site with no enclosing hooks makes its `Offload` those hooks (`frame.outer`), so its inputs
# go to host through the same path, and come back through it when recompute or replay needs them. Inside
# another site the inputs are that site's activations, rebuilt by it: nothing to offload. The outputs a
# policy saves go to the frame's `offload` (the site's, or the default one for `policies.offload(...)`):
# the pack hook returns their parcels, and the list that recompute reuses holds parcels from the end of
# forward on, brought back one by one as recompute reaches them. What the site recomputes is never copied.
