"""Device-agnostic tracking of live tensor storage bytes: `remat.track`.

torch keeps allocator statistics only for some accelerators (``torch.cuda.max_memory_allocated``),
never on CPU. `track` counts bytes itself, the same way on every device: a `TorchDispatchMode` sees
the outputs of every aten op run inside the block (forward, and backward too when it runs inside
the block), and each new storage is counted once, until it is released.

NOTE [ Storage lifetime ]
A tensor is not the unit of memory, its storage is: views share the storage of their base, and a
storage lives as long as any view of it, or autograd's saved copy of it, does. A finalizer on the
*tensor* would fire too early (the tensor dies, a view keeps the memory) and could not see a storage
that C++ alone keeps alive (a saved activation). torch preserves the Python object of an
``UntypedStorage`` for as long as its C++ ``StorageImpl`` lives ("PyObject preservation", as for
tensors): ``t.untyped_storage()`` returns the same object for every view of the storage, and that
object is deallocated exactly when the C++ storage is. A ``weakref.finalize`` on it is thus a
correct "storage released" event, also for storages that only autograd holds (tested in
tests/measure/test_track.py). A plain ``weakref.ref`` with a callback is used rather than
``weakref.finalize`` (cheaper: docs/benchmarks.md); the tracker keeps the reference, and dropping it when the
block ends drops the callback. Storages are keyed by ``untyped_storage()._cdata`` (the address of the
``StorageImpl``): unique among live storages, and the key is dropped when the finalizer fires,
before the address can be reused.

NOTE [ New or old storage ]
An op output's storage is new unless the op's schema says the output aliases an input (views,
in-place and ``out=`` ops: ``Tensor(a)`` in the schema) and the storage is indeed one of the
inputs' storages. One exception: ``torch.tensor(data)`` allocates outside the dispatcher's Python
key and shows the fresh tensor to modes only through ``aten.lift_fresh(fresh) -> fresh``, whose
schema says "alias"; its output counts as new. A storage that changed size (``resize_``, an
``out=`` op that resized its output) is re-counted at its new size.

NOTE [ A device's limit ]
``track(limit=...)`` makes the tracker behave as a device's allocator does when its memory runs out.
1. The limit bounds what the tracker counts on one device (``current(device)``): storages allocated in the block
   and still live. Tensors live before the block are not counted, as for the tracker's other numbers, so a dry
   run of a whole device allocates the model and optimizer inside the block (or passes the device's size less
   what they hold). ``meta`` storages (fake tensors under a plain tracker) are never limited.
2. A storage that would take a device over its limit raises ``torch.OutOfMemoryError`` from the op that made it,
   before the caller sees the op's output, and is not counted: the peak stays within the limit. A resize up
   (``untyped_storage().resize_``) is checked before the storage grows (NOTE [ Resized storages ]).
3. The check and the count happen under the tracker's lock, so two threads cannot both pass the check with
   room for one. The raise leaves the tracker as it was before the op; outputs of the same op that were counted
   before the one that crossed are released with the op's outputs, as any dropped storage is.

NOTE [ Devices that hold memory ]
1. ``peak_bytes`` and ``current_bytes`` count the devices that hold memory, all together; the ``meta`` device holds
   none and is left out of them.
2. Bytes on ``meta`` are still counted per device (``peak("meta")``).

Implementation notes:
1. (rule 1) Fake tensors (``FakeTensorMode``: the twin `remat.apply(budget=...)` plans on, `remat.estimate`'s step)
   have storages on ``meta`` with a real tensor's bytes; summed with real ones, a `remat.track()` around
   ``apply(budget=...)`` read several times the budget although nothing was allocated.

NOTE [ A fake tensor's device ]
1. A tracker that counts bytes only (`_sees_devices` off) answers ``prim.device`` for a fake tensor itself, as torch's
   fake tensors answer it, where the only mode below its own is the fake mode: no other mode could have seen the
   query, and the answer is the one the fake mode would give.

Implementation notes:
1. (rule 1) Autograd asks a fake tensor for its device (``prim.device``, through every mode on the stack) several
   times per op of a step: most of the queries a fake step's modes see, each otherwise a call through the
   dispatcher into the fake mode's Python.

NOTE [ Riders ]
1. A tracker can count for another (its host) without a dispatch mode of its own: it sees every op the host's mode
   sees and every resize the host is told of, from `_ride` until `_unride` or the host's exit (`_host_exited`).
2. The host's own counts come first: an op it refuses for its limit is seen by no rider.

Implementation notes:
1. (rule 1) A budgeted model's first step counts this way under the user's own `remat.track()` (NOTE [ The first
   step ] in remat/_budget/first_step.py): it pushes no mode in the user's block, and the user's numbers are those
   of the block alone.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol

import torch
from torch import nn

from .._core.public import claim
from .._core.torch_compat import (
    FakeTensor,
    FakeTensorMode,
    OpOverload,
    dispatch_mode_stack,
    fake_device,
    local_tensor,
    top_dispatch_mode,
)
from .._core.units import format_bytes, parse_memory
from .._engine.modes import Mode
from . import resize

__all__ = ["Limit", "Rider", "Tracker", "placed", "riding_host", "synchronize", "track"]

Limit = int | str | Mapping[str | torch.device, int | str]
"""A device's limit for `track`: bytes (an int or a string with a unit) for every device, or one per device."""

# Per op overload: for each return, whether its schema says that it aliases an input.
# See NOTE [ New or old storage ].
_ALIASING: dict[OpOverload, tuple[bool, ...]] = {}
_DEVICE = torch.ops.prim.device.default  # a tensor's device, asked of a subclass (a fake tensor) by C++


def _aliasing(func: OpOverload) -> tuple[bool, ...]:
    flags = _ALIASING.get(func)
    if flags is None:
        if func is torch.ops.aten.lift_fresh.default:
            flags = (False,)  # its input was made outside the dispatcher: a new storage
        else:
            flags = tuple(r.alias_info is not None for r in func._schema.returns)
        _ALIASING[func] = flags
    return flags


def _tensors(obj: object) -> Iterator[torch.Tensor]:
    """Yield the tensors in an op's argument or result: a tensor, or a list/tuple of tensors."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            if isinstance(item, torch.Tensor):
                yield item


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    t = local_tensor(t)  # a DTensor's local shard
    # a fake tensor's `is_meta` asks its mode for the device (`prim.device`, through every mode on the stack): its
    # `device` says the same without a dispatch
    if t.device.type == "meta" if isinstance(t, FakeTensor) else t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse tensors, subclasses without a storage
        return None


class Rider(Protocol):
    """What counts for a host tracker without a mode of its own (NOTE [ Riders ])."""

    def _see(self, func: OpOverload, args: Sequence[Any], kwargs: dict[str, Any] | None, out: Any) -> None: ...

    def _resizing(self, storage: torch.UntypedStorage, old: int, new: int) -> None: ...

    def _resized(self, storage: torch.UntypedStorage, old: int, new: int) -> None: ...

    def _host_exited(self) -> None: ...


class _TrackingMode(Mode):
    """The dispatch mode of one `Tracker`: runs every op and shows its outputs to the tracker (and its riders)."""

    def __init__(self, tracker: Tracker) -> None:
        super().__init__()
        self._tracker = tracker
        # NOTE [ A fake tensor's device ]: bytes only, and nothing but the fake mode below this one
        self._answers_devices = not tracker._sees_devices and all(
            isinstance(mode, FakeTensorMode) for mode in dispatch_mode_stack())

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is _DEVICE and self._answers_devices and len(args) == 1:
            device = fake_device(args[0])
            if device is not None:
                return device
        out = func(*args, **(kwargs or {}))
        tracker = self._tracker
        if func is _DEVICE and not tracker._sees_devices:
            return out
        tracker._see(func, args, kwargs, out)
        if tracker._riders:
            for rider in tracker._riders:
                rider._see(func, args, kwargs, out)
        return out


def riding_host() -> Tracker | None:
    """The tracker of a `remat.track()` block whose mode is on top of this thread's dispatch stack, for a rider
    (NOTE [ Riders ]); None where the top mode is another (remat's internal trackers included), or none is on."""
    mode = top_dispatch_mode()
    if isinstance(mode, _TrackingMode) and type(mode._tracker) is Tracker and mode._tracker._mode is mode:
        return mode._tracker
    return None


def placed(module: nn.Module) -> tuple[torch.device, ...]:
    """The devices other than the CPU that `module`'s parameters and buffers live on, sorted by name.

    Where a model runs, as opposed to `rng.devices_of` (whose generators a step may draw on: every index of an
    initialised accelerator too, wherever the model lives).

    >>> placed(nn.Linear(2, 2))
    ()
    """
    found = {t.device for t in (*module.parameters(), *module.buffers()) if t.device.type not in ("cpu", "meta")}
    return tuple(sorted(found, key=str))


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for the queued work of every device in `devices` (timings around asynchronous kernels)."""
    for device in devices:
        if device.type not in ("cpu", "meta"):
            sync = getattr(torch.get_device_module(device.type), "synchronize", None)
            if callable(sync):
                sync()


class Tracker:
    """Live tensor storage bytes per device, counted while a `track` block runs.

    Create one with `track`. Inside the block the numbers move as storages are allocated and
    released; after the block they stay at their values when it ended. Bytes are storage bytes
    (``untyped_storage().nbytes()``), not what an allocator reserved: caching allocators round up
    and keep freed blocks, which this does not see.

    Attributes:
        peak_bytes: The highest number of live bytes, all devices that hold memory together, seen in the block.
        current_bytes: Bytes live now (or when the block ended), all devices that hold memory together.

    The ``meta`` device holds no memory (fake tensors' storages live there, such as the twin a budget plans on):
    its bytes are shown apart, by ``peak("meta")`` and ``current("meta")``, never in the totals (NOTE
    [ Devices that hold memory ]).

    Example:
        >>> import torch, remat
        >>> with remat.track() as t:
        ...     x = torch.zeros(1000)          # 4000 bytes
        ...     y = x[:10]                     # a view: no new storage
        ...     del x, y
        >>> t.peak_bytes, t.current_bytes
        (4000, 0)
    """

    _sees_devices = True
    """Whether `_see` is shown `prim.device`, which only asks a subclass's tensor for its device and makes nothing:
    a tracker that counts ops needs it (a budget's profile prices each), one that counts bytes only does not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # storage key -> (device, bytes, weak reference whose callback releases the key)
        self._live: dict[int, tuple[torch.device, int, weakref.ref[torch.UntypedStorage]]] = {}
        self._current: dict[torch.device, int] = {}
        self._peak: dict[torch.device, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self._mode: _TrackingMode | None = None
        self._done = False
        self._riders: tuple[Rider, ...] = ()  # NOTE [ Riders ]
        # device, device type or _EVERY -> bytes; None: no limit. See NOTE [ A device's limit ].
        self._limits: dict[torch.device | str, int] | None = None

    # -- context manager ---------------------------------------------------------------------
    def __enter__(self) -> Tracker:
        if self._mode is not None or self._done:
            raise RuntimeError("remat: a Tracker can be entered only once; call remat.track() again instead.")
        self._mode = _TrackingMode(self)  # guarded once dynamo is in use: NOTE [ Modes without the dynamo guard ]
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        resize.watch(self)  # NOTE [ Resized storages ] in resize.py
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        mode, self._mode = self._mode, None
        self._done = True
        resize.unwatch(self)
        try:
            if mode is not None:
                mode.__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]
        finally:
            with self._lock:
                self._live.clear()  # dropping the weak references drops their callbacks
                riders, self._riders = self._riders, ()
            for rider in riders:
                rider._host_exited()

    def _ride(self, rider: Rider) -> None:
        """Show `rider` what this tracker counts from now on, until `_unride` or this block's end (NOTE [ Riders ])."""
        with self._lock:
            self._riders = (*self._riders, rider)

    def _unride(self, rider: Rider) -> None:
        """Stop showing `rider` what this tracker counts."""
        with self._lock:
            self._riders = tuple(r for r in self._riders if r is not rider)

    # -- queries -----------------------------------------------------------------------------
    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The devices on which a storage was seen, sorted by name."""
        return tuple(sorted(self._peak, key=str))

    def peak(self, device: str | torch.device) -> int:
        """Return the peak live bytes on one device (0 for a device never seen).

        Args:
            device: A device or its name. A name without an index (``"cuda"``) means the one
                device of that type seen, or index 0 if none was.

        Returns:
            Bytes.

        Raises:
            ValueError: ``device`` has no index and several devices of its type were seen.

        Example:
            >>> import torch, remat
            >>> with remat.track() as t:
            ...     _ = torch.ones(4, dtype=torch.float64)
            >>> t.peak("cpu")
            32
        """
        return self._peak.get(self._resolve(device), 0)

    def current(self, device: str | torch.device) -> int:
        """Return the live bytes on one device now, or when the block ended.

        Args:
            device: A device or its name, as for `peak`.

        Returns:
            Bytes (0 for a device never seen).

        Raises:
            ValueError: ``device`` has no index and several devices of its type were seen.

        Example:
            >>> import torch, remat
            >>> with remat.track() as t:
            ...     keep = torch.ones(4, dtype=torch.float64)
            >>> t.current("cpu")
            32
        """
        return self._current.get(self._resolve(device), 0)

    def _restart_peak(self) -> None:
        """Start the peak over from the bytes live now, to measure one phase of a tracked block on its own."""
        with self._lock:
            self._peak = dict(self._current)
            self.peak_bytes = self.current_bytes

    def __repr__(self) -> str:
        per_device = ", ".join(f"{d}: current={self._current.get(d, 0)} peak={self._peak[d]}" for d in self.devices)
        return f"Tracker(current_bytes={self.current_bytes}, peak_bytes={self.peak_bytes}, per_device={{{per_device}}})"

    def _resolve(self, device: str | torch.device) -> torch.device:
        dev = device if isinstance(device, torch.device) else torch.device(device)
        if dev.type == "cpu":
            return torch.device("cpu")
        if dev.index is not None:
            return dev
        same_type = [d for d in self._peak if d.type == dev.type]
        if len(same_type) > 1:
            names = ", ".join(sorted(map(str, same_type)))
            raise ValueError(
                f"remat: device {str(dev)!r} is ambiguous; this tracker saw {names}. Name the device with its index."
            )
        return same_type[0] if same_type else torch.device(dev.type, 0)

    def bytes_of(self, tensors: Sequence[torch.Tensor]) -> dict[torch.device, int]:
        """Bytes of the distinct storages of ``tensors`` that this tracker counts now, per device: what of its
        current bytes those tensors hold (a model's output, a loss), views sharing a storage counted once.

        >>> import torch, remat
        >>> with remat.track() as t:
        ...     x = torch.zeros(256)
        ...     held = t.bytes_of([x[:128], x[128:]])
        >>> held
        {device(type='cpu'): 1024}
        """
        out: dict[torch.device, int] = {}
        seen: set[int] = set()
        with self._lock:
            for t in tensors:
                st = _storage(t)
                if st is None or st._cdata in seen:
                    continue
                seen.add(st._cdata)
                entry = self._live.get(st._cdata)
                if entry is not None:
                    out[entry[0]] = out.get(entry[0], 0) + entry[1]
        return out

    # -- bookkeeping -------------------------------------------------------------------------
    def _see(
        self,
        func: OpOverload,
        args: Sequence[Any],
        kwargs: dict[str, Any] | None,
        out: Any,
    ) -> None:
        aliasing = _aliasing(func)
        results = out if isinstance(out, (tuple, list)) and len(aliasing) > 1 else (out,)
        inputs: set[int] | None = None
        try:
            for i, result in enumerate(results):
                aliases = aliasing[i] if i < len(aliasing) else False
                for t in _tensors(result):
                    st = _storage(t)
                    if st is None:
                        continue
                    key = st._cdata
                    entry = self._live.get(key)
                    if entry is not None:
                        nbytes = self._place(t, st)[1]
                        if entry[1] != nbytes:  # resized: see NOTE [ New or old storage ]
                            self._resize(key, nbytes)
                        continue
                    if aliases:
                        if inputs is None:
                            inputs = self._input_storages(args, kwargs)
                        if key in inputs:
                            continue
                    self._add(key, t, st)
        except _OverLimit as over:  # NOTE [ A device's limit ]
            raise over.error(str(func)) from None

    @staticmethod
    def _input_storages(args: Sequence[Any], kwargs: dict[str, Any] | None) -> set[int]:
        keys: set[int] = set()
        for arg in (*args, *(kwargs or {}).values()):
            for t in _tensors(arg):
                st = _storage(t)
                if st is not None:
                    keys.add(st._cdata)
        return keys

    def _place(self, t: torch.Tensor, st: torch.UntypedStorage) -> tuple[torch.device, int]:
        """The device a storage counts on and its bytes (a subclass may count fake tensors or allocator blocks)."""
        device = st.device
        return (torch.device("cpu") if device.type == "cpu" else device), st.nbytes()

    def _add(self, key: int, t: torch.Tensor, st: torch.UntypedStorage) -> None:
        device, nbytes = self._place(t, st)
        ref = weakref.ref(st, functools.partial(self._release, key))
        with self._lock:
            if self._limits is not None:
                self._admit(device, nbytes)
            self._live[key] = (device, nbytes, ref)
            self._account(device, nbytes)

    def _resize(self, key: int, nbytes: int) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is not None:
                if self._limits is not None and nbytes > entry[1]:
                    self._admit(entry[0], nbytes - entry[1])
                self._live[key] = (entry[0], nbytes, entry[2])
                self._account(entry[0], nbytes - entry[1])

    def _admit(self, device: torch.device, nbytes: int) -> None:
        """Raise `_OverLimit` if ``nbytes`` more would take ``device`` over its limit (lock held).

        See NOTE [ A device's limit ].
        """
        limit = self._limit(device)
        if limit is not None:
            live = self._current.get(device, 0)
            if live + nbytes > limit:
                raise _OverLimit(device, nbytes, live, limit)

    def _limit(self, device: torch.device) -> int | None:
        limits = self._limits
        if limits is None:
            return None
        found = limits.get(device)
        if found is None:
            found = limits.get(device.type)
        if found is None and device.type != "meta":
            found = limits.get(_EVERY)
        return found

    def _resizing(self, st: torch.UntypedStorage, old: int, new: int) -> None:
        """A storage is about to grow from ``old`` to ``new`` bytes outside the dispatcher: check the limit first."""
        if self._limits is not None:
            key = st._cdata
            with self._lock:
                entry = self._live.get(key)
                try:
                    if entry is not None:
                        if new > entry[1]:
                            self._admit(entry[0], new - entry[1])
                    elif old == 0:
                        self._admit(self._storage_device(st), new)
                except _OverLimit as over:
                    raise over.error("UntypedStorage.resize_") from None
        for rider in self._riders:
            rider._resizing(st, old, new)

    def _resized(self, st: torch.UntypedStorage, old: int, new: int) -> None:
        """A storage changed size outside the dispatcher (``untyped_storage().resize_``): NOTE [ Resized storages ].

        A counted storage is re-counted at its new size; one not counted that grows from nothing (FSDP's
        unsharded parameters, freed before the block) is counted from now on, as a new allocation.
        """
        for rider in self._riders:
            rider._resized(st, old, new)
        key = st._cdata
        if key in self._live:
            self._resize(key, self._storage_bytes(st))
        elif old == 0:
            device = self._storage_device(st)
            ref = weakref.ref(st, functools.partial(self._release, key))
            with self._lock:
                nbytes = self._storage_bytes(st)
                self._live[key] = (device, nbytes, ref)
                self._account(device, nbytes)

    def _storage_device(self, st: torch.UntypedStorage) -> torch.device:
        """The device a storage met without a tensor counts on."""
        device = st.device
        return torch.device("cpu") if device.type == "cpu" else device

    def _storage_bytes(self, st: torch.UntypedStorage) -> int:
        """The bytes a storage counts for (a subclass may round up to allocator blocks)."""
        return st.nbytes()

    def _release(self, key: int, ref: object = None) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self._account(entry[0], -entry[1])

    def _account(self, device: torch.device, delta: int) -> None:
        # Called with the lock held.
        cur = self._current.get(device, 0) + delta
        self._current[device] = cur
        if cur > self._peak.get(device, -1):
            self._peak[device] = cur
        if device.type == "meta":  # no memory: NOTE [ Devices that hold memory ]
            return
        self.current_bytes += delta
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes


def track(limit: Limit | None = None) -> Tracker:
    """Track live tensor storage bytes per device while a ``with`` block runs.

    Every storage allocated by an aten op inside the block is counted once (views share their
    base's storage) until it is released, on any device, CPU included. Tensors that existed before
    the block are not counted, even when they are freed inside it. A backward run inside the block
    is tracked too (its gradients and temporaries). Trackers nest: an inner one sees its own
    window, the outer one still counts everything. After the block, the numbers stay at their
    values at its end. See NOTE [ Storage lifetime ] for how a release is observed. Around a training
    step's forward and backward, ``peak_bytes`` is the step peak, what a budget bounds
    (``remat.apply(model, budget=...)``) and ``remat.plan(model)`` shows.

    With ``limit``, the block runs as on a device of that size: an op whose output would take the
    bytes the tracker counts on a device (`current`, which leaves out tensors live before the block)
    over that device's limit raises ``torch.OutOfMemoryError`` naming the limit, the bytes live and
    the op, before the op returns; the storage is not counted, so ``peak_bytes`` stays within the
    limit. To dry-run a training loop against a device size, build the model and optimizer inside
    the block (or pass the device's size less what they hold). See NOTE [ A device's limit ].

    Tracking costs a few microseconds per aten op: time code outside a tracker.

    Args:
        limit: The most bytes live on each device: an int, or a string with a unit (``"80GiB"``,
            ``"1.5GiB"``); or a dict from device (``"cuda:1"``, ``torch.device("cpu")``, or a type
            such as ``"cuda"`` for each device of that type) to its limit, devices not named being
            unlimited. ``meta`` is limited only when named. None (the default): no limit.

    Returns:
        A `Tracker`, to use as a context manager once.

    Raises:
        TypeError: ``limit`` is of another type (a float fraction, for one).
        ValueError: a limit cannot be read or is not positive.

    Example:
        >>> import torch, remat
        >>> with remat.track() as t:
        ...     a = torch.ones(256)         # 1024 bytes
        ...     b = torch.ones(256) * 2     # 1024 more; its operand is freed at once
        ...     del a
        >>> t.peak_bytes, t.current_bytes, t.devices
        (3072, 1024, (device(type='cpu'),))
        >>> with remat.track(limit="4KiB") as t:
        ...     keep = torch.ones(1000)     # 4000 bytes: fits
        ...     try:
        ...         more = torch.ones(100)  # 400 more: over 4096
        ...     except torch.OutOfMemoryError:
        ...         print("out of memory at", t.current_bytes)
        out of memory at 4000
    """
    tracker = Tracker()
    if limit is not None:
        tracker._limits = _read_limits(limit)
    return tracker


_EVERY = "*"  # the key of a limit for every device


def _read_limits(limit: Limit) -> dict[torch.device | str, int]:
    if isinstance(limit, Mapping):
        limits: dict[torch.device | str, int] = {}
        for device, value in limit.items():
            if not isinstance(device, (str, torch.device)):
                raise TypeError(f"remat: track's `limit` maps devices to bytes, but got the key {device!r} "
                                f"({type(device).__name__}); use a device or its name, such as 'cuda:0' or 'cuda'.")
            dev = torch.device(device)
            # "cpu" is the one CPU device; a type without an index ("cuda") limits each device of that type
            key: torch.device | str = dev if dev.index is not None else dev.type
            if dev.type == "cpu":
                key = torch.device("cpu")
            limits[key] = parse_memory(value, f"track's `limit[{device!r}]`")
        return limits
    return {_EVERY: parse_memory(limit, "track's `limit`")}


class _OverLimit(Exception):
    """Raised inside the tracker's bookkeeping when a storage would cross a limit; the caller names the op."""

    def __init__(self, device: torch.device, nbytes: int, live: int, limit: int) -> None:
        super().__init__(device, nbytes, live, limit)
        self.device, self.nbytes, self.live, self.limit = device, nbytes, live, limit

    def error(self, op: str) -> torch.OutOfMemoryError:
        return torch.OutOfMemoryError(
            f"remat: out of memory on {self.device} under remat.track(limit=...): {op} tried to allocate "
            f"{format_bytes(self.nbytes)} ({self.nbytes} bytes) with {format_bytes(self.live)} ({self.live} bytes) "
            f"live, over the limit of {format_bytes(self.limit)} ({self.limit} bytes). Hold less in the step "
            "(remat.apply(model, budget=...), a smaller batch) or raise the limit."
        )

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
