"""Record the aten ops a block runs (strategy "replay"); `tape.Tape` replays them in backward.

The design page of the docs explains replay (section "Rerun and replay").

See NOTE [ What the tape holds ] and NOTE [ Writes to outside memory ].
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .._core.policies import Policy
from .._core.torch_compat import UNSAFE_VIEW, version_of
from .debug import describe
from .guard import storage_key, written_arguments
from .kept import KeptOutput, keep_output
from .modes import Mode
from .rng import Draw, RngStash, draws, with_index

__all__ = ["Entry", "Marker", "OpInfo", "Outside", "Recorder", "Slot", "op_info", "pause", "recording", "resume"]

# NOTE [ What the tape holds ]
# 1. The tape never keeps an activation alive; tensors from outside it (inputs, parameters, constants) are held
#    strongly, because replay needs them, as a checkpoint keeps its inputs.
# 2. Entries hold no tensor, only ops, slots and plain values, so that two tapes compare in C (NOTE [ Shared
#    scripts ] in tape.py).
#
# Implementation notes:
# 1. (rules 1, 2) `Recorder.__torch_dispatch__` appends one entry per aten op: the op, its arguments with every tensor
#    replaced by its `Slot`, its first output slot, its output count and the grad mode. Slots number every op output
#    (one per returned element) and every tensor from outside.
# 2. (rule 1) A tensor's slot is found through its marker `(weakref, slot)`. Identity is the Python object: the
#    objects an op returns inside the mode are those autograd later shows the pack hook, and an in-place op returns
#    its input object, whose marker then moves to the in-place op's output slot (its new value).
#
# NOTE [ Writes to outside memory ]
# 1. An op that writes (in-place or `out=`) into memory of a tensor from outside the tape (BatchNorm's running
#    statistics, a user's buffer, `x.detach().add_(1)`) happens once, in forward; replay never touches the original.
# 2. Any other outside tensor changed between forward and backward is autograd's "modified by an inplace operation"
#    error: the tape would read a value that no longer exists.
#
# Implementation notes:
# 1. (rule 1) Before the first such write the recorder copies the whole outside storage; replay rebuilds every
#    outside tensor on it as a view of a fresh copy of the snapshot, so replayed writes land on the copy. Memory is
#    identified by storage, so any alias of the outside tensor, made inside or outside the tape, is covered.
# 2. (rule 2) Each is checked in backward against the version it had when first seen.


_Tensor = torch.Tensor
_ref = weakref.ref
_grad_enabled = torch.is_grad_enabled


class Slot(int):
    """A tensor's place on the tape, standing for the tensor in a recorded op's arguments.

    An `int`, so that replay indexes its values with it and tapes compare in C; its own type, so that replay tells
    it from a plain number argument. For one op overload the two never share a position: the schema types every
    argument as tensor or not.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Slot({int(self)})"


Marker = tuple["weakref.ReferenceType[torch.Tensor]", Slot]
# (op, args with Slots, kwargs with Slots or None, first output slot, output count (-1: one tensor), grad mode)
Entry = tuple[Any, list[Any], "dict[str, Any] | None", int, int, bool]


def _tensor_list(kind: Any) -> bool:
    """Whether a schema argument type is a list of tensors (`Tensor[]`, `Tensor?[]`, optional or not)."""
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    return isinstance(kind, torch.ListType) and "Tensor" in str(kind.getElementType())


def _aliases(argument: Any) -> Any:
    """The alias set of a schema argument (empty where it has none)."""
    return () if argument.alias_info is None else argument.alias_info.before_set


class OpInfo:
    """What the recorder needs to know about one op overload, read once from its schema."""

    __slots__ = ("beside", "lists", "name", "seeded", "slow", "writes")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        self.name = str(func)
        self.writes = written_arguments(func)
        # written arguments no return aliases (`rrelu_with_noise`'s noise, BatchNorm's running statistics): NOTE
        # [ Replay script ], rule 3
        returned = {alias for r in schema.returns if r.alias_info is not None for alias in r.alias_info.before_set}
        self.beside = frozenset(position for position, _ in self.writes
                                if not returned & set(_aliases(schema.arguments[position])))
        self.lists = any(_tensor_list(argument.type) for argument in schema.arguments)
        self.seeded = torch.Tag.nondeterministic_seeded in func.tags
        self.slow = bool(self.lists or self.writes or self.seeded)


_INFOS: dict[Any, OpInfo] = {}
_INFOS_LOCK = threading.Lock()
# The `id` of every op overload the fast path records (not `slow`). Ids, because an `OpOverload` hashes in
# Python; `_INFOS` keeps each overload alive, so an id is never reused for another op.
_FAST: set[int] = set()
_NOTHING_FAST: frozenset[int] = frozenset()


def op_info(func: Any) -> OpInfo:
    """Return the cached `OpInfo` of an op overload."""
    info = _INFOS.get(func)
    if info is None:
        info = OpInfo(func)
        with _INFOS_LOCK:
            _INFOS[func] = info
            if not info.slow:
                _FAST.add(id(func))
    return info


class Outside:
    """A tensor from outside the tape: the tensor (or what the enclosing hook packed), and its version."""

    __slots__ = ("dtype", "first", "offset", "packed", "shape", "storage", "stride", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, first: int) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.version = version_of(tensor)
        self.storage: int | None = None  # read only when an op writes (see `Recorder._outside_storages`)
        self.first = first  # the index of the first op that reads it
        self.packed: Any = None
        self.shape: tuple[int, ...] = ()
        self.stride: tuple[int, ...] = ()
        self.offset = 0
        self.dtype = tensor.dtype


def _seeded_device(args: Sequence[Any], kwargs: dict[str, Any] | None) -> torch.device:
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, _Tensor):
            return value.device
    device = (kwargs or {}).get("device")
    if device is None:
        return torch.get_default_device()
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return device
    return with_index(device) or device


class Recorder(Mode):
    """The dispatch mode that records a region's ops (see NOTE [ What the tape holds ])."""

    def __init__(
        self, preserve_rng: bool, trace: list[str] | None, policy: Policy | None = None,
        captured: dict[int, weakref.ref[torch.UntypedStorage]] | None = None,
    ) -> None:
        super().__init__()
        self.policy = policy
        # Outputs of the ops the policy keeps, by slot, detached, with their version (see NOTE [ Policies on the tape ]
        # and NOTE [ A kept output changed in place ] in kept.py).
        self.kept: dict[int, KeptOutput] = {}
        self.aliases: dict[int, int] = {}  # an `_unsafe_view` of a kept output's slot -> that output's slot
        # the kept ops that drew random numbers while `preserve_rng` is off: replay cannot run them again as they ran
        self.unrepeatable: set[int] = set()
        self.refs: dict[int, Marker] = {}
        self.ops: list[Entry] = []
        self.slots = 0
        self.outside: dict[int, Outside] = {}
        self.outside_storages: set[int] = set()
        self.scanned = 0  # how many of `outside` have their storage in `outside_storages`
        self.snapshots: dict[int, torch.UntypedStorage] = {}
        # Writes into the storage of a tensor the region already saved: (op index, that storage's weak reference,
        # as the region's `captured` holds it). Only these can change a saved tensor before replay takes it.
        # saved storages written: (op, storage, whether through an argument the op does not return: `OpInfo.beside`)
        self.writes: list[tuple[int, weakref.ref[torch.UntypedStorage], bool]] = []
        # The region's saved storages: storage key -> the storage, weakly (`RegionFrame.freed`).
        self.captured: dict[int, weakref.ref[torch.UntypedStorage]] = {} if captured is None else captured
        self.preserve_rng = preserve_rng
        self.cpu_rng: torch.Tensor | None = None
        self.device_rng: dict[torch.device, Any] = {}
        self.generators: dict[torch.Generator, torch.Tensor] = {}
        # per op the policy keeps that drew random numbers: its generator's state right after it (NOTE [ Random
        # ops ] in rng.py)
        self.draws: dict[int, Draw] = {}
        self.trace = trace
        self._paused = False
        self.fast: set[int] | frozenset[int] = _FAST if trace is None and policy is None else _NOTHING_FAST

    @property
    def paused(self) -> bool:
        """Whether ops pass through unrecorded (while a hook runs ops of its own)."""
        return self._paused

    @paused.setter
    def paused(self, flag: bool) -> None:
        self._paused = flag
        self.fast = _FAST if not flag and self.trace is None and self.policy is None else _NOTHING_FAST

    # -- the hot path --------------------------------------------------------------------------------------
    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if id(func) not in self.fast:  # a new op, a slow one, or recording paused or traced
            return self._dispatch(func, args, kwargs)
        refs = self.refs
        marked: list[Any] = []
        put = marked.append
        for arg in args:
            found = refs.get(id(arg))
            if found is not None and found[0]() is arg:
                put(found[1])
            elif isinstance(arg, _Tensor):
                put(self._outside(arg))
            else:
                put(arg)
        if kwargs:
            out = func._op(*args, **kwargs)
            marked_kwargs: dict[str, Any] | None = {key: self._mark(value) for key, value in kwargs.items()}
        else:
            out = func._op(*args)
            marked_kwargs = None
        first = self.slots
        if isinstance(out, _Tensor):
            refs[id(out)] = (_ref(out), Slot(first))
            self.slots = first + 1
            self.ops.append((func, marked, marked_kwargs, first, -1, _grad_enabled()))
        elif type(out) is tuple or type(out) is list:
            count = len(out)
            for index, item in enumerate(out):
                if isinstance(item, _Tensor):
                    refs[id(item)] = (_ref(item), Slot(first + index))
            self.slots = first + count
            self.ops.append((func, marked, marked_kwargs, first, count, _grad_enabled()))
        return out  # a Python number (`item()`) or nothing: no tensor to replay

    def _dispatch(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None) -> Any:
        """The general path: tensor lists, writes, random ops, debug traces, paused recording."""
        if self.paused:
            return func(*args, **(kwargs or {}))
        info = op_info(func)
        marked = [self._mark(arg) for arg in args]
        marked_kwargs = {key: self._mark(value) for key, value in kwargs.items()} if kwargs else None
        if info.writes:
            self._before_write(info, args, kwargs)
        if info.seeded and self.preserve_rng:
            self._stash_rng(args, kwargs)
        out = func(*args, **kwargs) if kwargs else func(*args)
        first = self.slots
        if isinstance(out, _Tensor):
            self.refs[id(out)] = (_ref(out), Slot(first))
            self.slots = first + 1
            count = -1
        elif type(out) is tuple or type(out) is list:
            count = len(out)
            for index, item in enumerate(out):
                if isinstance(item, _Tensor):
                    self.refs[id(item)] = (_ref(item), Slot(first + index))
            self.slots = first + count
        elif info.writes:
            count = 0
        else:
            if self.trace is not None:  # a number (`item()`): nothing to replay, but the trace shows it
                self.trace.append(describe(func, out))
            return out
        self.ops.append((func, marked, marked_kwargs, first, count, _grad_enabled()))
        if self.trace is not None:
            self.trace.append(describe(func, out))
        if func is UNSAFE_VIEW and self.kept and type(marked[0]) is Slot:  # rule 7 of the NOTE in kept.py
            source = self.aliases.get(marked[0], marked[0])
            kept = self.kept.get(source)
            if kept is not None:
                kept.watch_also(out)
                self.aliases[Slot(first)] = source
        # an op that writes into its arguments is never kept (NOTE [ A kept output changed in place ] in kept.py)
        if self.policy is not None and count != 0 and not info.writes and self.policy.saves_op(func):
            for index, item in enumerate((out,) if count < 0 else out):
                if isinstance(item, _Tensor):
                    self.kept[first + index] = keep_output(item)
            if info.seeded and draws(func, args, kwargs):
                if self.preserve_rng:
                    self.draws[len(self.ops) - 1] = Draw.after(args, kwargs)
                else:
                    self.unrepeatable.add(len(self.ops) - 1)
        return out

    # -- the slow paths ------------------------------------------------------------------------------------
    def _mark(self, value: Any) -> Any:
        found = self.refs.get(id(value))
        if found is not None and found[0]() is value:
            return found[1]
        if isinstance(value, _Tensor):
            return self._outside(value)
        if type(value) is list or type(value) is tuple:
            return type(value)(self._mark(item) for item in value)
        return value

    def _outside(self, tensor: torch.Tensor) -> Slot:
        slot = Slot(self.slots)
        self.slots = slot + 1
        self.outside[slot] = Outside(tensor, len(self.ops))
        self.refs[id(tensor)] = (_ref(tensor), slot)
        return slot

    def _outside_storages(self) -> set[int]:
        """The storages of every outside tensor seen so far (read lazily: only writes need them)."""
        records = self.outside
        if self.scanned < len(records):
            for record in list(records.values())[self.scanned:]:
                assert record.tensor is not None
                record.storage = storage_key(record.tensor)
                if record.storage is not None:
                    self.outside_storages.add(record.storage)
            self.scanned = len(records)
        return self.outside_storages

    def _before_write(self, info: OpInfo, args: Sequence[Any], kwargs: dict[str, Any] | None) -> None:
        """See NOTE [ Writes to outside memory ]: snapshot outside storage before its first write."""
        outside = self._outside_storages()
        for position, name in info.writes:
            value = args[position] if position < len(args) else (kwargs or {}).get(name)
            for tensor in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(tensor, _Tensor):
                    continue
                key = storage_key(tensor)
                if key is None:
                    continue
                # A key is an address, reused once its storage dies: the weak reference tells the saved storage
                # from a new one at the same address.
                saved = self.captured.get(key)
                if saved is not None and saved() is tensor.untyped_storage():
                    self.writes.append((len(self.ops), saved, position in info.beside))
                if key in outside and key not in self.snapshots:
                    self.snapshots[key] = tensor.untyped_storage().clone()  # type: ignore[no-untyped-call]

    def _stash_rng(self, args: Sequence[Any], kwargs: dict[str, Any] | None) -> None:
        """Read the generator state of the device a random op is about to draw from, once per device."""
        generator = (kwargs or {}).get("generator")
        if isinstance(generator, torch.Generator):
            if generator not in self.generators:
                self.generators[generator] = generator.get_state()
            return
        if self.cpu_rng is None:
            self.cpu_rng = torch.get_rng_state()
        device = _seeded_device(args, kwargs)
        if device.type not in ("cpu", "meta") and device not in self.device_rng:
            self.device_rng[device] = torch.get_device_module(device.type).get_rng_state(device)

    # -- end of forward ------------------------------------------------------------------------------------
    def keep_tagged(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """`remat.tag` inside a region whose policy saves `name`: keep the tensor's slot from forward."""
        assert self.policy is not None
        if self.policy.saves_name(name):
            slot = self.lookup(tensor)
            if slot is not None:
                self.kept[slot] = keep_output(tensor)
        return tensor

    def lookup(self, tensor: torch.Tensor) -> int | None:
        """The slot of a tensor made by the tape, or None for one from outside (or never seen)."""
        found = self.refs.get(id(tensor))
        if found is None or found[0]() is not tensor or found[1] in self.outside:
            return None
        return found[1]

    def rng(self) -> RngStash | None:
        """The generator states read before the first random op of each device (None: no random op ran)."""
        if self.cpu_rng is None:
            return None
        return RngStash(self.cpu_rng, tuple(self.device_rng.items()))


# The replay regions recording on this thread, so that a recompute keeps its ops off their tapes.
#
# NOTE [ Recompute is not recorded ]
# 1. Every recording on the thread is paused while a recompute runs: the ops a site's recompute runs inside a
#    region's forward (a gradient inside the block) are not the block's.
#
# Implementation notes:
# 1. (rule 1) What such a recompute rebuilds enters the block only through the unpack hook, as a tensor the tape
#    keeps as one from outside. Recorded, a replay would run those ops again with the block's RNG state instead of
#    the state they ran under, and rebuild other values.

class _Recording(threading.local):
    def __init__(self) -> None:
        self.stack: list[Any] = []  # the recorders (`recorder.Recorder`) of the regions open on this thread


_recording = _Recording()


def recording() -> list[Any]:
    """This thread's open recorders, innermost last: a region pushes its recorder when it opens, pops it when it
    ends."""
    return _recording.stack


def pause() -> list[tuple[Any, bool]] | None:
    """Pause every recorder of this thread; None when there is none (the common case: one attribute read)."""
    stack = _recording.stack
    if not stack:
        return None
    paused = [(recorder, recorder.paused) for recorder in stack]
    for recorder in stack:
        recorder.paused = True
    return paused


def resume(paused: list[tuple[Any, bool]] | None) -> None:
    """Undo `pause`."""
    if paused is not None:
        for recorder, flag in paused:
            recorder.paused = flag
