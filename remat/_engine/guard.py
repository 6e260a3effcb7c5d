"""Keep recompute from updating module buffers, or module attributes, a second time (side effects once).

See NOTE [ Writes during recompute ] and NOTE [ Attributes during recompute ].
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .._core.torch_compat import GlobalModuleHooks, storage_id
from .modes import Mode

__all__ = ["BufferWrites", "guard_buffers", "keep_buffers", "release", "storage_key", "written_arguments"]

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


_storage_id: Callable[[torch.Tensor], int] = storage_id


def storage_key(tensor: torch.Tensor) -> int | None:
    """The identity of a tensor's storage, shared by all its views; None for tensors without one (sparse)."""
    try:
        return _storage_id(tensor)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _buffer_memory(module: nn.Module) -> set[int | None]:
    keys = {storage_key(buffer) for buffer in module._buffers.values() if buffer is not None}
    keys.discard(None)
    return keys


class BufferWrites(Mode):
    """Run ops that write to the given memory on clones of those arguments."""

    def __init__(self, protected: set[int | None]) -> None:
        super().__init__()
        self.protected = protected

    def _protected(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and storage_key(value) in self.protected

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        writes = written_arguments(func)
        if kwargs is None:
            kwargs = {}
        if writes:
            args = list(args)
            for position, name in writes:
                if position < len(args) and self._protected(args[position]):
                    args[position] = args[position].clone()
                elif name in kwargs and self._protected(kwargs[name]):
                    kwargs = {**kwargs, name: kwargs[name].clone()}
        return func._op(*args, **kwargs)  # `_op`: no Python frame of `OpOverload.__call__`


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
        mode = BufferWrites(_buffer_memory(module))
        mode.__enter__()  # type: ignore[no-untyped-call]
        _local.open.append((module, mode))


def _leave_module(module: nn.Module, args: Any, output: Any) -> None:
    opened = _local.open
    if _local.depth and opened and opened[-1][0] is module:
        opened.pop()[1].__exit__(None, None, None)  # type: ignore[no-untyped-call]


_global_hooks = GlobalModuleHooks(_KEY, _enter_module, _leave_module)


def guard_buffers(root: nn.Module | None) -> BufferWrites | None:
    """Start keeping module buffers and attributes as forward left them, for a recompute on this thread; see
    `release`.

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
    if root is None:
        return None
    attributes.enter(root)
    if not root._buffers:
        return None
    mode = BufferWrites(_buffer_memory(root))
    mode.__enter__()  # type: ignore[no-untyped-call]
    return mode


def release(mode: BufferWrites | None) -> None:
    """End what `guard_buffers` started, and put back the module attributes the recompute changed."""
    global _users
    if mode is not None:
        mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
    _local.attributes.pop().restore()
    _local.depth -= 1
    _lock.acquire()
    _users -= 1
    if not _users:
        _global_hooks.remove()
    _lock.release()


@contextmanager
def keep_buffers(root: nn.Module | None = None) -> Iterator[None]:
    """`guard_buffers` and `release` around a block: modules called inside leave their buffers as they are."""
    mode = guard_buffers(root)
    try:
        yield
    finally:
        release(mode)
