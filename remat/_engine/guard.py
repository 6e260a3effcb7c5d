"""Keep recompute from updating module buffers, or module attributes, a second time (side effects once), and from
reading a buffer forward changed after it read it.

See NOTE [ Writes during recompute ], NOTE [ Buffers read before forward changed them ] and NOTE [ Attributes during
recompute ].
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .._core.errors import RecomputeMismatchError
from .._core.torch_compat import GlobalModuleHooks, storage_id
from .modes import Mode

__all__ = [
    "BufferWrites", "BufferVersions", "StaleReads", "buffer_versions", "guard_buffers", "keep_buffers", "release",
    "saved_in_recompute", "stale_read", "storage_key", "written_arguments",
]

# NOTE [ Writes during recompute ]
# Forward already applied every in-place update to module buffers: BatchNorm's running statistics and
# `num_batches_tracked`, a user's counters. Recompute must compute the same values without applying those
# updates a second time (torch.utils.checkpoint applies them twice, pytorch issue 96136).
#
# Rules:
# 1. While a rerun recompute runs, an op that writes to a buffer of a module (the site's own module, and every
#    module called) runs on a clone of it instead, also through views of it.
# 2. The forward path pays nothing, and recompute pays per op only inside modules that own buffers.
# 3. Writes to other tensors from outside (a tensor a closure captured) are not redirected by rerun; replay
#    redirects every write to a tensor from outside the region (NOTE [ Writes to outside memory ] in recorder.py).
#
# Implementation notes:
# 1. (rule 1) Global module hooks see every module called; inside a module that owns buffers (and inside the
#    site's own module), `BufferWrites` does the redirection. A buffer is named by its storage (`storage_key`),
#    so writes through views are caught too.
# 2. (rule 1) Some ops write to arguments that their schema does not mark as written: `native_batch_norm` (and its
#    cuDNN and MIOpen forms) updates `running_mean` and `running_var` in training, yet declares them `Tensor?`.
#    Those writes are listed in `_UNDECLARED` by hand, or BatchNorm's statistics would be updated twice.

# NOTE [ Buffers read before forward changed them ]  (for users: the docs' design page, "Side effects")
# A forward may read a module buffer and then change it in place: Batch Renormalization's correction from the
# running statistics, then their update; a scale read, then moved. Rerun's recompute runs after forward, so it reads
# the buffer as forward left it, not as forward read it, and rebuilds other tensors than forward saved: gradients
# silently wrong, as torch.utils.checkpoint's. Rerun cannot know the value forward read (keeping every buffer at
# every call would cost forward memory and time), so it refuses such a recompute.
#
# Rules:
# 1. A rerun recompute raises `RecomputeMismatchError`, naming the buffer and the site, where a tensor it saves for
#    backward, or the output of a module that owns buffers, or a Python number it reads, depends on a stale read: a
#    read of a buffer that forward changed in place (counted from the site module's buffers at forward's start and
#    end) before recompute reached its first write to it, or a read followed in recompute by a write to it.
# 2. A stale read whose values only feed writes to buffers is harmless (spectral norm's power iteration: its update
#    goes to a copy, and what forward's later reads saw is what recompute reads): no error.
# 3. Forward pays one look at its buffers' versions per call of a module site whose modules own buffers; nothing
#    for a site without buffers or a function site. Recompute pays only inside modules that own buffers (NOTE
#    [ Writes during recompute ], rule 2).
#
# Implementation notes:
# 1. (rule 1) `StaleReads` follows values inside the `BufferWrites` modes: each tensor an op makes carries the reads
#    of buffers it depends on, as (buffer, writes recompute had sent to copies when read). Only ops inside modules
#    that own buffers are seen, so a read made outside them (a parent reading a child's buffer) goes unchecked; a
#    function site knows no forward writes and catches only reads that recompute itself sees written later (not
#    past an early stop).
# 2. (rule 2) A write's own read of the buffer it updates (an in-place op's `self`) counts as a read only for the
#    write's result, which the caller usually drops; BatchNorm's undeclared writes (`_UNDECLARED`) neither read nor
#    count, so a training BatchNorm is never stale. InstanceNorm with running statistics hands BatchNorm copies of
#    them (`running_mean.repeat(b)`), which autograd saves (before the op reaches the mode) although backward never
#    reads them in training: a training BatchNorm op takes back what saving its statistics' arguments noted.
# 3. (rule 3) Which modules of a site own buffers is found at its first call and kept (`buffer_versions`): a module
#    with buffers added to the site later goes unchecked.
# 4. (rule 1) What a stale read reaches is refused even where it ends equal to forward's (a flag read as a Python
#    condition that chose a one-time initialization forward ran and recompute skips): the check sees which values
#    depend on the read, not whether they came out the same. Replay runs such code exactly.

# NOTE [ Attributes during recompute ]  (for users: the docs' design page, "Side effects")
# A forward may also change its modules' plain Python attributes: `self.calls += 1`, `self.last_len = n`.
# Rerun runs that Python again, so without care a counter counts every step twice. The first time a recompute
# enters a module (the site's own module, and every module the global hooks see), its `__dict__` is copied,
# one C-level dict copy; when the recompute ends, every entry whose object changed, compared by identity, is
# put back, unless the old object is a tensor or a module (those have their own rules: buffers above,
# submodules stay as they are). So assigned attributes end as forward left them. A container changed in place
# (`self.history.append(x)`) keeps the same identity and is not restored; nor is a tensor a closure captured
# (replay, `strategy="replay"` or `remat.region()`, redirects those writes).

Writes = tuple[tuple[int, str], ...]
_BN_STATS = ("running_mean", "running_var")
_UNDECLARED = {
    "aten::native_batch_norm": _BN_STATS,
    "aten::cudnn_batch_norm": _BN_STATS,
    "aten::miopen_batch_norm": _BN_STATS,
}
_WRITES: dict[Any, Writes] = {}
_STATISTICS, _TRAINING = (3, 4), 5  # the positions of `running_mean`, `running_var` and `training` in those ops


def written_arguments(func: Any) -> Writes:
    """The `(position, name)` of every argument the aten overload `func` writes to, declared or not (found once per
    overload)."""
    writes = _WRITES.get(func)
    if writes is None:
        schema = func._schema
        undeclared = _UNDECLARED.get(schema.name, ())
        writes = _WRITES[func] = tuple(
            (position, argument.name)
            for position, argument in enumerate(schema.arguments)
            if (argument.alias_info is not None and argument.alias_info.is_write) or argument.name in undeclared
        )
    return writes


_READS: dict[Any, tuple[tuple[int, ...], tuple[str, ...]]] = {}


def _read_arguments(func: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The positions, then the names (keyword-only), of the tensor arguments whose values the aten overload `func`
    reads: all but those it writes other than an in-place op's `self` (NOTE [ Buffers read before forward changed
    them ], implementation note 2); found once per overload."""
    found = _READS.get(func)
    if found is None:
        schema = func._schema
        written = {position for position, _ in written_arguments(func)}
        if schema.name not in _WRITE_ONLY:
            written.discard(0)
        arguments = [(position, argument) for position, argument in enumerate(schema.arguments)
                     if "Tensor" in str(argument.type) and position not in written]
        found = _READS[func] = (
            tuple(position for position, argument in arguments if not argument.kwarg_only),
            tuple(argument.name for _, argument in arguments if argument.kwarg_only),
        )
    return found


_storage_id: Callable[[torch.Tensor], int] = storage_id


def storage_key(tensor: torch.Tensor) -> int | None:
    """The identity of a tensor's storage, shared by all its views; None for tensors without one (sparse)."""
    try:
        return _storage_id(tensor)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _own_buffers(module: nn.Module) -> list[tuple[torch.Tensor, int, str]]:
    """`module`'s own buffers, each with its storage and the name errors give it."""
    return [
        (buffer, key, f"{type(module).__name__}.{name}") for name, buffer in module._buffers.items()
        if buffer is not None and (key := storage_key(buffer)) is not None
    ]


Taint = frozenset[tuple[int, int]]  # (a buffer's storage, the writes to it recompute had sent to copies then)
_WRITE_ONLY = frozenset({"aten::copy_", "aten::fill_", "aten::zero_"})  # write their `self` without reading it
_SCALAR_READ = "aten::_local_scalar_dense"  # `item()`, `float(t)`, `bool(t)`: a value Python goes on with


class StaleReads:
    """What one recompute read of module buffers: see NOTE [ Buffers read before forward changed them ]."""

    __slots__ = ("buffers", "changed", "escaped", "names", "taint", "writes")

    def __init__(self, changed: frozenset[int]) -> None:
        self.changed = changed  # the buffers forward changed in place, by storage
        self.names: dict[int, str] = {}  # every buffer of the modules recompute entered, by storage
        self.buffers: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}  # the same by id: tensor (weakly), storage
        self.writes: dict[int, int] = {}  # per buffer, the writes recompute sent to copies so far
        self.taint: dict[int, tuple[weakref.ref[torch.Tensor], Taint]] = {}  # by id: the tensor, weakly
        # what reached the gradients (and the tensor's id, 0 for a Python number), and the reads it depends on
        self.escaped: list[tuple[str, int, Taint]] = []

    def entered(self, buffers: list[tuple[torch.Tensor, int, str]]) -> None:
        """Recompute entered a module with these buffers (`_own_buffers`)."""
        for buffer, key, name in buffers:
            self.names[key] = name
            self.buffers[id(buffer)] = (weakref.ref(buffer), key)

    def of(self, value: Any) -> Taint | None:
        """The buffer reads `value` depends on (a tensor made inside a module that owns buffers), if any."""
        found = self.taint.get(id(value))
        if found is not None and found[0]() is value:
            return found[1]
        return None

    def read(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Taint | None:
        """The buffer reads the op's outputs depend on: the buffers among its tensor arguments (NOTE [ Buffers read
        before forward changed them ], implementation note 2 for those it writes), and what those carry."""
        positions, names = _read_arguments(func)
        found: set[tuple[int, int]] | None = None
        for position in positions:
            if position >= len(args):
                break
            value = args[position]
            for item in (value if type(value) in (list, tuple) else (value,)):
                taint = self._one(item)
                if taint:
                    found = set(taint) if found is None else found | taint
        for name in names:
            taint = self._one(kwargs.get(name))
            if taint:
                found = set(taint) if found is None else found | taint
        return None if found is None else frozenset(found)

    def _one(self, value: Any) -> Taint | None:
        """A buffer itself (its views are made inside the mode, so they carry its read), or what `value` carries."""
        buffer = self.buffers.get(id(value))
        if buffer is not None and buffer[0]() is value:
            return frozenset(((buffer[1], self.writes.get(buffer[1], 0)),))
        return self.of(value)

    def made(self, func: Any, out: Any, taint: Taint) -> None:
        """Mark what the op made as depending on `taint`; a Python number read from it reaches the gradients."""
        if func._schema.name == _SCALAR_READ:
            self.escaped.append(("a Python number read from it (`item()`, `float()`, a condition)", 0, taint))
            return
        for value in (out if type(out) in (list, tuple) else (out,)):
            if isinstance(value, torch.Tensor):
                self.taint[id(value)] = (weakref.ref(value), taint)

    def written_only(self, args: Any, positions: tuple[int, ...]) -> None:
        """The op wrote these arguments without reading them (a training BatchNorm's statistics: implementation
        note 2): what they carry reaches nothing through it, although autograd saved them as the op began."""
        ids = {id(args[position]) for position in positions}
        self.escaped = [entry for entry in self.escaped if entry[1] not in ids]
        for key in ids:
            self.taint.pop(key, None)

    def reached(self, what: str, values: Any) -> None:
        """Note the buffer reads `values` (a tensor, or a tuple or list of them) depend on, as reaching the
        gradients through `what`."""
        if not self.taint:
            return
        for value in (values if type(values) in (list, tuple) else (values,)):
            taint = self.of(value)
            if taint:
                self.escaped.append((what, id(value), taint))

    def stale(self) -> tuple[str, str] | None:
        """The first stale read that reached the gradients: the buffer's name, and what it reached; None where there
        is none."""
        for what, _, taint in self.escaped:
            for key, writes in taint:
                if writes < max(self.writes.get(key, 0), key in self.changed):
                    return self.names.get(key, "a buffer"), what
        return None


class BufferWrites(Mode):
    """Run ops that write to `module`'s own buffers on clones of those arguments, and follow for `reads` what buffers
    the ops' outputs depend on (NOTE [ Buffers read before forward changed them ])."""

    def __init__(self, module: nn.Module, reads: StaleReads) -> None:
        super().__init__()
        buffers = _own_buffers(module)
        self.protected = {key for _, key, _ in buffers}
        self.reads = reads
        reads.entered(buffers)

    def _protected(self, value: Any) -> int | None:
        if isinstance(value, torch.Tensor) and (key := storage_key(value)) in self.protected:
            return key
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        writes = written_arguments(func)
        if kwargs is None:
            kwargs = {}
        reads = self.reads
        taint = reads.read(func, args, kwargs)
        if writes:
            args = list(args)
            counted = func._schema.name not in _UNDECLARED
            for position, name in writes:
                if position < len(args) and (key := self._protected(args[position])) is not None:
                    args[position] = args[position].clone()
                elif name in kwargs and (key := self._protected(kwargs[name])) is not None:
                    kwargs = {**kwargs, name: kwargs[name].clone()}
                else:
                    continue
                if counted:
                    reads.writes[key] = reads.writes.get(key, 0) + 1
        out = func._op(*args, **kwargs)  # `_op`: no Python frame of `OpOverload.__call__`
        if reads.escaped and func._schema.name in _UNDECLARED and args[_TRAINING]:
            reads.written_only(args, _STATISTICS)
        if taint:
            reads.made(func, out, taint)
        return out


class BufferVersions:
    """The versions of a module site's buffers when its forward started, to find those forward changed in place
    (NOTE [ Buffers read before forward changed them ], rule 3)."""

    __slots__ = ("buffers", "versions")

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.versions = [buffer._version for buffer in buffers]

    def changed(self) -> frozenset[int]:
        """The storages of the buffers forward changed."""
        return frozenset(
            key for buffer, version in zip(self.buffers, self.versions, strict=True)
            if buffer._version != version and (key := storage_key(buffer)) is not None
        )


# per site module, weakly, its modules that own buffers, weakly too (the module is among them where it owns some)
_owners: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[nn.Module], ...]] = weakref.WeakKeyDictionary()


def buffer_versions(module: nn.Module) -> BufferVersions | None:
    """The versions of the buffers of `module` and its submodules now; None where none owns buffers."""
    owners = _owners.get(module)
    if owners is None:
        owners = _owners[module] = tuple(weakref.ref(sub) for sub in module.modules() if sub._buffers)
    if not owners:
        return None
    # an inference tensor has no version, and cannot be changed in place outside inference mode
    return BufferVersions([
        b for owner in owners if (sub := owner()) is not None
        for b in sub._buffers.values() if b is not None and not b.is_inference()
    ])


_MISSING = object()


class _EnteredDicts:
    """The `__dict__` of each module one recompute entered, as it was on entry; see NOTE [ Attributes during
    recompute ]."""

    __slots__ = ("before",)

    def __init__(self) -> None:
        self.before: dict[int, tuple[nn.Module, dict[str, Any]]] = {}

    def enter(self, module: nn.Module) -> None:
        if id(module) not in self.before:
            self.before[id(module)] = (module, module.__dict__.copy())

    def restore(self) -> None:
        for module, before in self.before.values():
            now = module.__dict__
            for key, old in before.items():
                if now.get(key, _MISSING) is not old and not isinstance(old, (torch.Tensor, nn.Module)):
                    now[key] = old


class _GuardState(threading.local):
    def __init__(self) -> None:
        self.depth = 0  # recomputes running on this thread
        self.open: list[tuple[nn.Module, BufferWrites]] = []
        self.attributes: list[_EnteredDicts] = []  # one per recompute running on this thread, innermost last
        self.reads: list[StaleReads] = []  # the same


_local = _GuardState()
_lock = threading.Lock()
_users = 0
# The global hooks go straight into torch's tables under a key of their own, no `RemovableHandle`: installing
# and removing them is on the path of every recompute (see `GlobalModuleHooks` for the cost of each way).
_KEY = -0x5E3A7


def _enter_module(module: nn.Module, args: Any) -> None:
    if not _local.depth:
        return
    _local.attributes[-1].enter(module)
    if module._buffers:
        mode = BufferWrites(module, _local.reads[-1])
        mode.__enter__()  # type: ignore[no-untyped-call]
        _local.open.append((module, mode))


def _leave_module(module: nn.Module, args: Any, output: Any) -> None:
    opened = _local.open
    if _local.depth and opened and opened[-1][0] is module:
        opened.pop()[1].__exit__(None, None, None)  # type: ignore[no-untyped-call]
        _local.reads[-1].reached(f"the output of `{type(module).__name__}`", output)


def saved_in_recompute(tensor: torch.Tensor) -> None:
    """Recompute saved `tensor` for backward: note the buffer reads it depends on (NOTE [ Buffers read before
    forward changed them ], rule 1)."""
    reads = _local.reads
    if reads and reads[-1].taint:
        reads[-1].reached("a tensor it saves for backward", tensor)


_global_hooks = GlobalModuleHooks(_KEY, _enter_module, _leave_module)


def guard_buffers(root: nn.Module | None, changed: frozenset[int] = frozenset()) -> BufferWrites | None:
    """Start keeping module buffers and attributes as forward left them, for a recompute on this thread, and
    checking its reads of buffers (`changed`: those forward changed in place, by storage); see `release`.

    Returns the mode that guards `root`'s own buffers (its forward is called directly, without the module
    hooks), to hand to `release`.
    """
    global _users
    # On the path of every recompute: the lock taken without `with` (`with` costs more), around statements
    # that cannot raise.
    _lock.acquire()
    if not _users:
        _global_hooks.install()
    _users += 1
    _lock.release()
    _local.depth += 1
    attributes = _EnteredDicts()
    _local.attributes.append(attributes)
    reads = StaleReads(changed)
    _local.reads.append(reads)
    if root is None:
        return None
    attributes.enter(root)
    if not root._buffers:
        return None
    mode = BufferWrites(root, reads)
    mode.__enter__()  # type: ignore[no-untyped-call]
    return mode


def release(mode: BufferWrites | None) -> tuple[str, str] | None:
    """End what `guard_buffers` started, and put back the module attributes the recompute changed.

    Returns the first stale read of a buffer that reached the gradients (`StaleReads.stale`: NOTE [ Buffers read
    before forward changed them ]), for `stale_read`; None where there is none.
    """
    global _users
    if mode is not None:
        mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
    _local.attributes.pop().restore()
    stale = _local.reads.pop().stale()
    _local.depth -= 1
    _lock.acquire()
    _users -= 1
    if not _users:
        _global_hooks.remove()
    _lock.release()
    return stale


def stale_read(site: str, found: tuple[str, str]) -> RecomputeMismatchError:
    """The error for a stale read `release` found in the recompute of `site`."""
    buffer, what = found
    return RecomputeMismatchError(
        f"remat: the recompute of `{site}` in backward read the buffer `{buffer}` as forward left it, where forward "
        f"read it before changing it in place, and {what} depends on that read, so it rebuilds other tensors than "
        "forward saved and the gradients would be wrong (torch.utils.checkpoint gives them silently). Use "
        "strategy='replay' for this site, which replays forward's values, or change the buffer outside the site."
    )


@contextmanager
def keep_buffers(root: nn.Module | None = None, site: str | None = None) -> Iterator[None]:
    """`guard_buffers` and `release` around a block: modules called inside leave their buffers as they are. Where
    the block recomputes `site`, a stale read of a buffer (NOTE [ Buffers read before forward changed them ]) raises
    `RecomputeMismatchError` once the block ends well; elsewhere (a profile's run) none is looked for."""
    mode = guard_buffers(root)
    try:
        yield
    except BaseException:
        release(mode)
        raise
    stale = release(mode)
    if stale is not None and site is not None:
        raise stale_read(site, stale)
