"""Copies between a device and host memory for `remat.offload`: lanes (side streams), parcels, prefetch.

See NOTE [ Offload lifecycle ].
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any

import torch

from .._core.errors import RematError
from .._core.torch_compat import graph_task_id

__all__ = ["Parcel", "Stay", "host_bytes", "live_parcels", "reap"]

# NOTE [ Offload lifecycle ]
# An offloaded saved tensor goes to host memory in forward and comes back in backward, overlapping compute on a
# side stream, without ever synchronizing the device.
#
# Rules:
# 1. Forward (pack): autograd keeps a `Parcel` (a host copy) instead of a qualifying saved tensor. The device
#    tensor's memory is never handed to a kernel while the copy still reads it, and nothing sleeps.
# 2. Backpressure: the device holds at most `_PENDING_BYTES` of tensors whose copies to host are in flight.
# 3. Backward (unpack): the parcel comes back into a fresh device tensor, and the compute stream waits on that
#    copy on the device, not on the host; the copies of the next parcels backward needs start ahead of it.
# 4. Lifetime: the host copy lives as long as the parcel, i.e. as long as autograd's saved variable: freed after
#    the node ran, or when the graph is dropped; `retain_graph=True` keeps it for the next backward, which copies
#    again. What a backward brought back is its own and dies with it.
# 5. Devices without streams (the CPU with `include_cpu=True`, for tests; MPS; a backend written in Python) run
#    the same functions with synchronous copies.
#
# Implementation notes:
# 1. (rule 1) The host tensor is pinned when the tensor comes from an accelerator and `pin_memory` is set; the
#    copy runs on the device's side stream after that stream waited for the compute stream (which made the
#    tensor), and an event is recorded after it. The device tensor is not freed by us: its reference goes into
#    the lane's `pending` queue with the event, and leaves it once the event has completed (`_Lane.reap`, polled
#    without blocking on every pack and unpack, and by `reap()`).
# 2. (rule 2) Compute makes activations faster than a host link copies them, so the queue is bounded: past
#    `_PENDING_BYTES`, the oldest tensor's stream (the compute stream) waits on its copy's event, on the device,
#    and the reference is dropped at once: kernels queued after that wait, the only ones that can get its memory,
#    run after the copy. Compute then runs ahead of the copies by that much, which keeps the side stream busy.
# 3. (rule 3) The fresh tensor is allocated on the compute stream and copied on the side stream after it waited
#    for the compute stream, so memory the compute stream freed is not overwritten early. Prefetch: parcels are
#    chained in the order they were packed (`prev`, a weak link, per thread and device); unpacking one starts
#    copying back the `_AHEAD` nearest earlier ones that are still alive, since backward needs them next (one:
#    with per-block remat, the previous block's input copies while this block recomputes and back-propagates;
#    more would hold more blocks' inputs on the device for no gain).
# 4. (rule 4) A tensor brought back belongs to its graph task (two backwards over one graph never share one) and
#    is held for as many unpacks as the parcel has users (a tensor saved by two nodes comes back once); a
#    callback at the end of that backward drops whatever was brought back and not used.
# 5. (rule 5) torch.cpu's streams are no-ops and its events are None, so copies are synchronous and nothing is
#    ever pending. A device without streams copies into host memory that is not pinned: with synchronous copies
#    pinning gains nothing, and such a backend may have no pinned allocator at all.

_AHEAD = 1  # parcels copied back ahead of the one being unpacked
_WALK = 8  # at most this many links followed when looking for them
_PENDING_BYTES = 64 << 20  # bytes of device tensors held per device while their copies to host run

_graph_task_id = graph_task_id

_INPLACE = (
    "remat: one of the variables needed for gradient computation has been modified by an inplace "
    "operation: a tensor of shape {shape} saved under remat.offload was at version {before} when saved and is "
    "at version {after} now. Don't modify it in place between forward and backward (clone it first)."
)


class _Lane:
    """Copies between one device and host memory: a side stream on accelerators, plain copies on CPU."""

    __slots__ = ("device", "lock", "module", "pending", "pending_bytes", "stream")

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
        # (event, device tensor, the stream it was made on, bytes): see NOTE [ Offload lifecycle ]
        self.pending: collections.deque[tuple[Any, torch.Tensor, Any, int]] = collections.deque()
        self.pending_bytes = 0
        self.lock = threading.Lock()

    def _compute(self) -> Any:
        return self.module.current_stream(self.device if self.module is not torch.cpu else None)

    def out(self, tensor: torch.Tensor, pin: bool) -> torch.Tensor:
        """Copy `tensor` into a new host tensor; its memory stays referenced until the copy is done."""
        pin = pin and self.module is not torch.cpu  # pinned memory only helps copies that run asynchronously
        host = torch.empty_like(tensor, device="cpu", pin_memory=pin)
        compute = self._compute()
        self.stream.wait_stream(compute)
        with self.module.stream(self.stream):
            host.copy_(tensor, non_blocking=pin)
            event = self.stream.record_event()
        if event is not None:
            nbytes = host.untyped_storage().nbytes()
            with self.lock:
                self.pending.append((event, tensor.detach(), compute, nbytes))
                self.pending_bytes += nbytes
                self._throttle()
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
                self.pending_bytes -= pending.popleft()[3]

    def _throttle(self) -> None:
        """Past `_PENDING_BYTES` in flight, hand the oldest tensors back to the allocator (lock held).

        The stream a tensor was made on first waits for its copy (a wait on the device, not on the host), so
        no later kernel of that stream can reuse its memory before the copy has read it.
        """
        pending = self.pending
        while self.pending_bytes > _PENDING_BYTES and len(pending) > 1:
            event, _, made_on, nbytes = pending.popleft()
            if not event.query():
                made_on.wait_event(event)
            self.pending_bytes -= nbytes


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
