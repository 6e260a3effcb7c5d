"""Copies between a device and host memory for `remat.offload`: lanes (side streams), host copies, prefetch.

See NOTE [ What crosses ] and NOTE [ Offload lifecycle ].
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from .._core.errors import RematError
from .._core.torch_compat import graph_task_id

__all__ = ["Chained", "Parcel", "Stay", "Traffic", "offloaded_bytes", "live_parcels", "pack", "prefetch", "reap",
           "traffic"]

# NOTE [ What crosses ]
# What goes to host is memory, not tensors: a stretch of a saved tensor's storage, copied as one piece.
#
# Rules:
# 1. Every copy between a device and host memory is a plain memcpy: both sides contiguous, of one shape and
#    dtype (a contiguous tensor that is its whole storage crosses as it is; any other stretch as one dimension).
#    torch's `copy_` stages any other copy between a device and the host through temporaries it allocates
#    itself, and for a host side that is not contiguous that temporary is pageable host memory, a copy the host
#    waits for: the q, k and v that attention saves (views of one projection, with strides of their own) took
#    that path. A memcpy writes straight into the host tensor offload allocated, pinned from torch's caching
#    host allocator on a device with streams, whatever the saved tensor's layout, strides or dtype.
# 2. Views of one storage share one copy. When a tensor's storage holds at most `_WHOLE` times the tensor's
#    elements, the whole storage is copied, and every later saved view of it (same dtype, same version) is
#    rebuilt from that copy with its own sizes, strides and offset: q, k and v split from one projection cross
#    once, as one stretch; a tensor saved by two ops crosses once. A tensor that is a small part of a larger
#    storage (a slice of a big buffer) crosses alone: the stretch it spans when that stretch holds nothing else,
#    else a contiguous gather of it made on the device.
# 3. Each copy crosses at most once each way per backward: what a backward brought back is held for all the
#    saved tensors that share it, prefetch skips what this backward already brought back, and a copy whose device
#    memory is still held (its copy to host still in flight, as for the last tensors of forward when backward
#    begins) is used where it is instead of copied back.
# 4. Counted (`traffic()`): copies and bytes each way, the unpacks served from device memory still held, and the
#    copies with pageable host memory on a device that has streams (none unless `pin_memory=False`).

# NOTE [ Offload lifecycle ]
# An offloaded saved tensor goes to host memory in forward and comes back in backward, overlapping compute on
# side streams, without ever synchronizing the device.
#
# Rules:
# 1. Forward (pack): autograd keeps a `Parcel` (a place in a host copy) instead of a qualifying saved tensor. The
#    device memory is never handed to a kernel while the copy still reads it, and nothing sleeps.
# 2. Backpressure: the device holds at most `_PENDING_BYTES` of memory whose copies to host are in flight.
# 3. Backward (unpack): the copy comes back into fresh device memory, and the compute stream waits on that copy
#    on the device, not on the host; the copy backward needs next starts ahead of it.
# 4. Lifetime: a host copy lives as long as a parcel that points into it, i.e. as long as autograd's saved
#    variables: freed after their nodes ran, or when the graph is dropped; `retain_graph=True` keeps it for the
#    next backward, which copies again. What a backward brought back is its own and dies with it.
# 5. Devices without streams (the CPU with `include_cpu=True`, for tests; MPS; a backend written in Python) run
#    the same functions with synchronous copies.
# 6. Two paces. A site's copies (its inputs, what its policy keeps: `early`) go as rules 2 and 3 say: they may stay
#    in flight while forward runs on, and come back one ahead of their use, because a site's recompute runs a
#    whole block between two of its unpacks, compute that hides a copy, and a copy is small next to the block it
#    rebuilds. What autograd saves straight into an offload block (everything else) is consumed node by node,
#    with little compute between two unpacks: a copy in flight or brought back ahead would sit on the device
#    beside the node's own tensors and raise the step's peak by up to the largest saved tensor. So such a copy
#    holds no device memory past its pack (the compute stream waits for it, on the device) and comes back only
#    when its node asks: the device holds what `torch.autograd.graph.save_on_cpu` would, and the host never
#    waits.
#
# Implementation notes:
# 1. (rule 1) Copies to host run on the device's out stream, copies back on its back stream (two streams, so
#    that the first copies backward needs do not queue behind forward's last copies to host: a device copies
#    both ways at once). A copy to host runs after its stream waited for the compute stream (which made the
#    memory), and an event is recorded after it. The device memory is not freed by us: a reference goes into the
#    lane's `pending` queue with the event, and leaves it once the event has completed (`_Lane.reap`, polled
#    without blocking on every pack and unpack, and by `reap()`). Until then the copy points at it (`device`).
# 2. (rule 2) Compute makes activations faster than a host link copies them, so the queue is bounded: past
#    `_PENDING_BYTES`, the oldest memory's stream (the compute stream) waits on its copy's event, on the device,
#    and the reference is dropped at once: kernels queued after that wait, the only ones that can get the memory,
#    run after the copy. Compute then runs ahead of the copies by that much, which keeps the out stream busy.
# 3. (rule 3) Fresh device memory is allocated on the compute stream and copied into on the back stream after it
#    waited for the compute stream, so memory the compute stream freed is not overwritten early. The two side
#    streams do not order each other: a copy comes back only once the lane let go of its device memory (its
#    copy to host completed, or the compute stream waited for it, which the back stream's wait then includes);
#    until then backward uses the device memory itself (`_Copy._bring`). Prefetch: copies are chained in the
#    order they were made (`prev` and `next`, weak links, per thread and device); unpacking one starts bringing
#    back the `_AHEAD` nearest earlier one that this backward has not brought back yet (autograd runs backward
#    in reverse, so it needs that one next), and the next one if this backward has not brought it back (a
#    site's recompute runs forward again, asking for what its policy kept in the order it was made; one node
#    unpacks what it saved in that order too). With per-block remat that is one block ahead: the previous
#    block's input copies back while this block recomputes and back-propagates, and what a block's policy kept
#    comes back during the block after it, one copy per unpack there. More would hold more on the device for
#    no gain: backward is as fast as the slower of compute and the link either way. A walk stops, too, at a copy
#    of several users (a block's input, unpacked by its recompute and again by the ops that saved it) brought back
#    ahead and not used yet: that block is the one ahead already. Each of those unpacks walks, and walking on past
#    it brought one block more back each time (a third block input on the device, or every block's input long
#    before its backward); a block input this block is still using (unpacked, with unpacks left) is passed, so
#    that what the block before it kept comes back during this one. A copy packed again after
#    later copies were made (a tensor every block takes, as a transformer's rotary tables, copied with the first
#    block) sits in the chain where the first block is, not where backward needs it: unpacking it prefetches
#    nothing, or every block's backward would bring the first blocks' copies back with it.
# 4. (rule 4) Memory brought back belongs to its graph task (two backwards over one graph never share it) and is
#    held for as many unpacks as the copy has users (parcels handed out); a callback at the end of that backward
#    drops whatever was brought back and not used.
# 5. (rule 5) torch.cpu's streams are no-ops and its events None, so copies are synchronous and nothing is ever
#    pending. A device without streams copies into host memory that is not pinned: with synchronous copies
#    pinning gains nothing, and such a backend may have no pinned allocator at all (the device of
#    tests/pydevice.py has none: torch asks its C++ hooks for one).
# 6. (rule 6) The offload block's pack hook tells the two paces apart by who calls it: a nested site hands its
#    inputs to the enclosing pack hook from two places (`Frame.hand_over` for rerun frames, before their own hooks
#    are pushed and from inside them; `Tape.hand_to` for a region's tape: NOTE [ Inputs of nested sites ] in
#    hooks.py); any other caller is autograd saving a tensor in the block. An unpack brings ahead only copies
#    of the early pace, and stops at the first of the other.

_AHEAD = 1  # copies brought back ahead of the one being unpacked
_WALK = 16  # at most this many links followed when looking for it (past copies this backward brought back)
_PENDING_BYTES = 64 << 20  # bytes of device memory held per device while its copies to host run
_WHOLE = 4  # a storage up to this many times a saved view's elements is copied whole (NOTE [ What crosses ])


_INPLACE = (
    "remat: one of the variables needed for gradient computation has been modified by an inplace "
    "operation: a tensor of shape {shape} saved under remat.offload was at version {before} when saved and is "
    "at version {after} now. Don't modify it in place between forward and backward (clone it first)."
)


class _Lane:
    """Copies between one device and host memory: side streams on accelerators, plain copies on CPU."""

    __slots__ = ("asynchronous", "back_stream", "device", "lock", "module", "out_stream", "pending", "pending_bytes")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        module: Any = torch.get_device_module(device.type)
        if device.type == "cpu" or not all(hasattr(module, name) for name in ("Stream", "current_stream", "stream")):
            # CPU, or a backend without streams (MPS): torch.cpu's no-op streams, synchronous copies
            self.module: Any = torch.cpu
            self.out_stream: Any = torch.cpu.Stream()
            self.back_stream: Any = self.out_stream
            self.asynchronous = False
        else:
            self.module = module
            self.out_stream = module.Stream(device=device)
            self.back_stream = module.Stream(device=device)
            self.asynchronous = True
        # (event, device memory, the stream it was made on, bytes, its copy): see NOTE [ Offload lifecycle ]
        self.pending: collections.deque[tuple[Any, torch.Tensor, Any, int, weakref.ref[_Copy]]] = collections.deque()
        self.pending_bytes = 0
        self.lock = threading.Lock()

    def _compute(self) -> Any:
        return self.module.current_stream(self.device if self.module is not torch.cpu else None)

    def out(self, source: torch.Tensor, pin: bool, copy: weakref.ref[_Copy], nbytes: int,
            early: bool = True) -> torch.Tensor:
        """Copy the contiguous `source` into a new host tensor; hold `source` until the copy is done (`early`), or
        make the compute stream wait for the copy at once (NOTE [ Offload lifecycle ], rule 6)."""
        pin = pin and self.asynchronous  # pinned memory only helps copies that run asynchronously
        host = _host(source, pin)
        compute = self._compute()
        stream = self.out_stream
        stream.wait_stream(compute)
        with self.module.stream(stream):
            host.copy_(source, non_blocking=pin)
            event = stream.record_event()
        _stats.made(nbytes, self.asynchronous and not pin)
        if event is not None and not early:
            compute.wait_event(event)  # on the device: what the compute stream runs next sees the copy done
        elif event is not None:
            with self.lock:
                self.pending.append((event, source, compute, nbytes, copy))
                self.pending_bytes += nbytes
                self._throttle()
        return host

    def back(self, host: torch.Tensor, pinned: bool) -> tuple[torch.Tensor, Any, Any]:
        """Start copying `host` into new device memory.

        Returns the device tensor, the event that marks the end of the copy, and the stream it was allocated
        on (the compute stream), which must wait on that event before the tensor is used or freed.
        """
        tensor = torch.empty_like(host, device=self.device, memory_format=torch.contiguous_format)
        compute = self._compute()
        stream = self.back_stream
        stream.wait_stream(compute)
        with self.module.stream(stream):
            tensor.copy_(host, non_blocking=pinned)
            event = stream.record_event()
        _stats.moved(host.numel() * host.element_size(), self.asynchronous and not pinned)
        return tensor, event, compute

    def wait(self, event: Any, allocated: Any) -> None:
        """Make the compute stream (not the host) wait until the copy that recorded `event` is done."""
        compute = self._compute()
        compute.wait_event(event)
        if allocated != compute:
            allocated.wait_event(event)

    def reap(self) -> None:
        """Release the device memory whose copy to host has finished (never blocks)."""
        pending = self.pending
        if not pending:
            return
        with self.lock:
            while pending and pending[0][0].query():
                self._release(pending.popleft())

    def _release(self, entry: tuple[Any, torch.Tensor, Any, int, weakref.ref[_Copy]]) -> None:
        self.pending_bytes -= entry[3]
        copy = entry[4]()
        if copy is not None:
            copy.device = None

    def _throttle(self) -> None:
        """Past `_PENDING_BYTES` in flight, hand the oldest memory back to the allocator (lock held).

        The stream it was made on first waits for its copy (a wait on the device, not on the host), so no later
        kernel of that stream can reuse the memory before the copy has read it.
        """
        pending = self.pending
        while self.pending_bytes > _PENDING_BYTES and len(pending) > 1:
            entry = pending.popleft()
            if not entry[0].query():
                entry[2].wait_event(entry[0])
            self._release(entry)


def _host(source: torch.Tensor, pin: bool) -> torch.Tensor:
    """New contiguous host memory for a copy of `source`: pinned (torch's caching host allocator) when `pin`."""
    return torch.empty_like(source, device="cpu", pin_memory=pin, memory_format=torch.contiguous_format)


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
    """Release all device memory whose copy to host has finished; never blocks.

    >>> reap()
    """
    for lane in list(_lanes.values()):
        lane.reap()


class Traffic(NamedTuple):
    """Copies between devices and host memory since the last reset (NOTE [ What crosses ], rule 4)."""

    out: int  # copies to host
    out_bytes: int
    back: int  # copies back to a device
    back_bytes: int
    kept: int  # copies not brought back: their device memory was still held when backward needed them
    kept_bytes: int
    pageable: int  # copies, either way, with host memory that is not pinned on a device that has streams


class _Stats:
    """Bytes of live host copies, and the traffic (for the benchmark and the tests)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current = self.peak = self.copies = 0
        self.counts = [0] * len(Traffic._fields)

    def made(self, nbytes: int, pageable: bool) -> None:
        """A host copy was made: it lives, and it crossed."""
        counts = self.counts
        with self.lock:
            self.current += nbytes
            self.copies += 1
            if self.current > self.peak:
                self.peak = self.current
            counts[0] += 1
            counts[1] += nbytes
            counts[6] += pageable

    def freed(self, nbytes: int) -> None:
        with self.lock:
            self.current -= nbytes
            self.copies -= 1

    def moved(self, nbytes: int, pageable: bool) -> None:
        """A copy came back."""
        counts = self.counts
        with self.lock:
            counts[2] += 1
            counts[3] += nbytes
            counts[6] += pageable

    def kept(self, nbytes: int) -> None:
        with self.lock:
            self.counts[4] += 1
            self.counts[5] += nbytes


_stats = _Stats()


def offloaded_bytes(reset_peak: bool = False) -> tuple[int, int]:
    """Bytes of host copies alive now, and the most alive at once since the last reset.

    >>> offloaded_bytes(reset_peak=True)[0] >= 0
    True
    """
    with _stats.lock:
        current, peak = _stats.current, _stats.peak
        if reset_peak:
            _stats.peak = _stats.current
    return current, peak


def live_parcels() -> int:
    """How many host copies of offloaded memory are alive right now.

    >>> live_parcels() >= 0
    True
    """
    return _stats.copies


def traffic(reset: bool = False) -> Traffic:
    """Copies between devices and host memory so far (since the last reset): see `Traffic`.

    >>> traffic(reset=True).pageable >= 0
    True
    """
    with _stats.lock:
        counts = Traffic(*_stats.counts)
        if reset:
            _stats.counts[:] = [0] * len(Traffic._fields)
    return counts


class _LastCopy(threading.local):
    """The last copy made on this thread, per device: see NOTE [ Offload lifecycle ], prefetch."""

    def __init__(self) -> None:
        self.last: dict[torch.device, weakref.ref[_Copy]] = {}


_chain = _LastCopy()


def _dead() -> None:
    """A weak reference that is gone."""


_Ready = tuple[int, torch.Tensor, Any, Any, int]  # graph task, device memory, event, stream it was allocated on, uses


class _Copy:
    """The host copy of a stretch of device memory, and its way back (NOTE [ What crosses ])."""

    __slots__ = (
        "__weakref__", "device", "early", "fetched", "host", "lane", "nbytes", "next", "pinned", "prev", "ready",
        "ref", "spread", "start", "storage", "users", "version", "view",
    )

    def __init__(
        self, lane: _Lane, source: torch.Tensor, start: int, version: int, view: Any, pin: bool, early: bool = True
    ) -> None:
        self.lane = lane
        self.early = early  # its pace: may stay in flight and come back ahead of its use (NOTE [ Offload lifecycle ])
        self.start = start  # where the stretch begins in its storage, in elements
        self.version = version  # of the saved tensor: a later view of the same storage shares only at that version
        self.view = view  # for a gather: the (sizes, strides, offset) it holds, the only view it serves
        self.nbytes = 0  # until the copy is made
        self.users = 0  # parcels handed out
        self.spread = False  # packed again after later copies were made: NOTE [ Offload lifecycle ], note 3
        self.fetched = -2  # the last backward that brought it back
        # On its way back, for one backward. Memory dropped unused must first make the stream it was allocated on
        # wait for the copy into it (`_let_go`), or the allocator could hand it to a kernel while the copy writes.
        self.ready: _Ready | None = None
        self.ref = ref = weakref.ref(self)
        self.storage: Callable[[], Any] = _dead  # the storage it copies, when views of it may share it
        pinned = self.pinned = pin and lane.asynchronous
        # the device memory while its copy to host runs (cleared by the lane when it lets go)
        self.device: tuple[torch.Tensor, int] | None = (
            (source, source._version) if lane.asynchronous and early else None)
        nbytes = source.numel() * source.element_size()
        self.host = lane.out(source, pinned, ref, nbytes, early)
        self.nbytes = nbytes
        self.next: weakref.ref[_Copy] | None = None
        last = _chain.last
        self.prev = prev = last.get(lane.device)
        last[lane.device] = ref
        if prev is not None:
            before = prev()
            if before is not None:
                before.next = ref

    def __del__(self) -> None:
        if self.ready is not None:
            _let_go(self.ready)
        if self.nbytes:
            _stats.freed(self.nbytes)

    def serves(self, dtype: torch.dtype, shape: Any, stride: Any, offset: int, end: int, version: int) -> bool:
        """Whether a view of the same storage can be rebuilt from this copy."""
        if version != self.version or dtype != self.host.dtype:
            return False
        if self.view is not None:
            return bool(self.view == (shape, stride, offset))
        return self.start <= offset and end <= self.start + self.host.numel()

    def take(self) -> torch.Tensor:
        """The device memory with the copied values: brought back now, prefetched, or still held."""
        gid = graph_task_id()
        ready = self.ready
        if ready is not None:
            with _prefetch_lock:
                ready = self.ready
                if ready is not None and ready[0] == gid:
                    left = ready[4]
                    self.ready = (gid, ready[1], ready[2], ready[3], left - 1) if left > 1 else None
                else:
                    ready = None
        if ready is not None:
            _, tensor, event, allocated, _ = ready
        else:
            tensor, event, allocated = self._bring()
            if gid != -1:
                self.fetched = gid
                if self.users > 1:
                    self._hold(gid, tensor, event, allocated, self.users - 1)
        lane = self.lane
        lane.reap()
        if gid != -1 and not self.spread:
            self._prefetch(gid)
        if event is not None:
            lane.wait(event, allocated)
        return tensor

    def _bring(self) -> tuple[torch.Tensor, Any, Any]:
        held = self.device
        if held is not None:  # its copy to host may still run: the host memory is not to be read yet
            _stats.kept(self.nbytes)
            return held[0], None, None
        # Released: its copy to host finished, or the compute stream waited for it, and so does the back stream
        # now (`back` waits for the compute stream): the host memory holds the values.
        return self.lane.back(self.host, self.pinned)

    def _hold(self, gid: int, tensor: torch.Tensor, event: Any, allocated: Any, left: int) -> None:
        """Keep memory brought back for `left` more unpacks in backward `gid` (dropped when it ends)."""
        with _prefetch_lock:
            if self.ready is not None:
                _let_go(self.ready)
            self.ready = (gid, tensor, event, allocated, left)
            waiting = _waiting.get(gid)
            if waiting is None:
                waiting = _waiting[gid] = []
                torch.autograd.Variable._execution_engine.queue_callback(lambda: _drop_ready(gid))
            waiting.append(self.ref)

    def _prefetch(self, gid: int) -> None:
        """Start bringing back what backward `gid` needs next (NOTE [ Offload lifecycle ], note 3)."""
        prefetch(self, lambda copy: copy.fetched == gid,
                 lambda copy: copy.ready is not None and copy.ready[0] == gid and copy.ready[4] == copy.users,
                 lambda copy: copy._fetch(gid))

    def _fetch(self, gid: int) -> None:
        self.fetched = gid
        self._hold(gid, *self._bring(), self.users)


class Chained(Protocol):
    """A copy in the chain an unpack walks: `_Copy`, and the estimate's stand-in for it on fake tensors."""

    @property
    def prev(self) -> weakref.ref[Any] | None: ...
    @property
    def next(self) -> weakref.ref[Any] | None: ...
    @property
    def users(self) -> int: ...
    @property
    def early(self) -> bool: ...


_C = TypeVar("_C", bound=Chained)


def prefetch(copy: _C, brought: Callable[[_C], bool], unused: Callable[[_C], bool],
             fetch: Callable[[_C], None]) -> None:
    """What unpacking `copy` brings back ahead (NOTE [ Offload lifecycle ], note 3): the next copy, and the nearest
    earlier one that this backward has not brought back (`brought`), stopping at a block input brought back ahead and
    none of whose unpacks ran yet (`unused`) and at a copy of the late pace; `fetch` starts bringing one back."""
    link = copy.next
    if link is not None:
        after = link()
        if after is not None and after.early and not brought(after):
            fetch(after)
    ahead = walked = 0
    link = copy.prev
    while link is not None and ahead < _AHEAD and walked < _WALK:
        before = link()
        if before is None:
            return
        walked += 1
        link = before.prev
        if brought(before):  # NOTE [ What crosses ], rule 3
            if before.users > 1 and unused(before):  # a block input ahead already
                return
            continue
        if not before.early:  # it comes back when its node asks for it (NOTE [ Offload lifecycle ], rule 6)
            return
        fetch(before)
        ahead += 1


_prefetch_lock = threading.Lock()
_waiting: dict[int, list[weakref.ref[_Copy]]] = {}


def _drop_ready(gid: int) -> None:
    """End of a backward: forget what was brought back for it and not used (a node it did not run)."""
    with _prefetch_lock:
        for ref in _waiting.pop(gid, ()):
            copy = ref()
            if copy is not None and copy.ready is not None and copy.ready[0] == gid:
                _let_go(copy.ready)
                copy.ready = None


def _let_go(ready: _Ready) -> None:
    """Before memory brought back is dropped unused: its stream waits for the copy into it."""
    if ready[2] is not None:
        ready[3].wait_event(ready[2])


class Parcel:
    """What autograd keeps for an offloaded tensor: where it lies in a host copy, and how to bring it back."""

    __slots__ = ("copy", "offset", "shape", "source", "stride", "version")

    def __init__(self, copy: _Copy, tensor: torch.Tensor, shape: Any, stride: Any, offset: int) -> None:
        copy.users += 1
        self.copy = copy
        # where it lies in the copy's memory; no stride: the copy as it is, with the tensor's sizes and strides
        self.shape, self.stride, self.offset = shape, stride, offset
        self.source = weakref.ref(tensor)  # to tell an in-place change while it lives, as autograd would
        self.version = tensor._version

    def get(self) -> torch.Tensor:
        """The unpack: a device tensor with the saved values (prefetched, still held, or copied back now).

        Parcels that share a copy bring it back once per backward; it stays until the last of them has been
        unpacked (or that backward ends), as the memory itself would.
        """
        tensor, held = self.source(), self.copy.device
        if tensor is not None and tensor._version != self.version:
            raise RematError(_INPLACE.format(shape=list(tensor.shape), before=self.version, after=tensor._version))
        if held is not None and held[0]._version != held[1]:  # its memory, still held, was written since
            raise RematError(_INPLACE.format(shape=list(held[0].shape), before=held[1], after=held[0]._version))
        memory = self.copy.take()  # brought back (offset 0), or the device memory still held (any offset)
        if self.stride is None:
            return memory
        return memory.as_strided(self.shape, self.stride, memory.storage_offset() + self.offset)


def pack(tensor: torch.Tensor, pin: bool, shared: dict[int, weakref.ref[_Copy]], early: bool = True) -> Parcel:
    """Copy `tensor`'s memory to host, or point into a copy already made of it (NOTE [ What crosses ]).

    `shared` maps a storage (its id) to the last copy made of it, for one `remat.offload` object; `early` is the
    copy's pace (NOTE [ Offload lifecycle ], rule 6).
    """
    memory = tensor.detach()  # what the lane holds while the copy runs: the memory, not the graph
    lane = _lane(tensor.device)
    version = tensor._version
    shape, stride = tensor.shape, tensor.stride()
    if tensor.is_conj() or tensor.is_neg():  # the bits live on the tensor, not in its memory: a gather, unshared
        source = memory.resolve_conj().resolve_neg().contiguous().view(-1)
        lane.reap()
        gather = _Copy(lane, source, 0, version, (shape, stride, int(tensor.storage_offset())), pin, early)
        return Parcel(gather, tensor, shape, _contiguous(shape), 0)
    storage = tensor.untyped_storage()
    offset = int(tensor.storage_offset())
    key = id(storage)
    found = shared.get(key)
    copy = None if found is None else found()
    if copy is not None and copy.storage() is storage:
        if copy.serves(tensor.dtype, shape, stride, offset, _view_end(shape, stride, offset), version):
            if copy.next is not None and copy.next() is not None:
                copy.spread = True
            if copy.view is not None:  # a gather: the same view again
                return Parcel(copy, tensor, shape, _contiguous(shape), 0)
            return Parcel(copy, tensor, shape, stride, offset - copy.start)
    lane.reap()
    numel = int(tensor.numel())
    total, rest = divmod(storage.nbytes(), tensor.element_size())
    view: tuple[Any, ...] | None = None
    start = 0
    if total <= _WHOLE * numel and not rest:  # the whole storage: its other views share the copy
        if numel == total and tensor.is_contiguous():  # the tensor is its storage: it crosses as it is
            place: tuple[Any, int] = (None, 0)
            source = memory
        else:
            place, source = (stride, offset), memory.as_strided((total,), (1,), 0)
    elif _view_end(shape, stride, offset) - offset == numel:  # the stretch it spans holds nothing else
        start, place = offset, (stride, 0)
        source = memory.as_strided((numel,), (1,), offset)
    else:  # a sparse part of a larger storage: a contiguous gather, made on the device
        view = (shape, stride, offset)
        place = (_contiguous(shape), 0)
        source = memory.contiguous().view(-1)
    copy = _Copy(lane, source, start, version, view, pin, early)
    copy.storage = weakref.ref(storage)
    shared[key] = copy.ref
    if len(shared) > 4096:
        for stale in [k for k, ref in shared.items() if ref() is None]:
            del shared[stale]
    return Parcel(copy, tensor, None if place[0] is None else shape, *place)


def _view_end(shape: Any, stride: Any, offset: int) -> int:
    """One past the last element a (non-empty) view reaches in its storage."""
    end = offset + 1
    for size, step in zip(shape, stride, strict=True):
        end += (size - 1) * step
    return end


def _contiguous(shape: Any) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


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
