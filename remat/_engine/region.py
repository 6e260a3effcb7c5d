"""The replay strategy's frame and entry points (`begin_replay`, `end_replay`), behind `with remat.region():`
(`Region`, below), `@remat.region()` and `@remat(strategy="replay")`.

A region records the aten ops its block runs (`recorder.Recorder`) and gives autograd handles instead of the
activations made inside; backward replays the tape (`tape.Tape.replay`). See NOTE [ What the tape holds ] in
recorder.py, NOTE [ Handle lifetime ] in hooks.py, and NOTE [ Region entry ] and NOTE [ Kept tensors ] below.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

from .._core import switch as _switch
from .._core.errors import BUG, RecomputeMismatchError, RematError, check_runs_when_called
from .._core.options import Options
from .._core.policies import Policy, as_policy, tags
from .._core.public import claim
from .._core.torch_compat import pop_saved_hooks, push_saved_hooks, storage_id
from .compiled import compiled_key, compiling, context_for, in_compiled_call, torch_checkpoint, warn_once
from .guard import storage_key
from .hooks import Frame, Handle, Kept
from .offload import Offload, for_kept, resolve
from .recorder import Recorder, op_info, recording
from .tape import Tape
from .transfer import Parcel, Stay

__all__ = ["Region", "RegionFrame", "begin_replay", "end_replay"]


_storage_id: Callable[[torch.Tensor], int] = storage_id
_ref = weakref.ref

# NOTE [ Kept tensors ]
# 1. Saved tensors that the region does not rebuild (tensors from outside, views of them, tensors the tape never saw)
#    are kept by reference.
# 2. A kept tensor whose version changed before backward raises autograd's own "modified by an inplace operation"
#    error instead of giving a wrong gradient.
# 3. Inside an enclosing site (another region, a rerun site, `save_on_cpu`) they are handed to its pack hook instead
#    (NOTE [ Inputs of nested sites ] in hooks.py); so are the outside tensors the tape reads, at the end of forward.
#
# Implementation notes:
# 1. (rule 2) With hooks installed autograd no longer checks versions on unpack, so the region keeps each with the
#    version it had when saved and compares.

_VALUES_DIFFER = (
    "remat: replay of `{site}` rebuilt saved tensor #{index} (output {output} of op #{op}, {name}) with other "
    "values than forward saved ({detail}). Something changed that tensor outside the PyTorch dispatcher (a raw "
    "Triton or CUDA kernel launch, a write through `.numpy()` or `data_ptr()`), which the tape cannot see: "
    "do that outside the region, or use strategy='rerun'."
)


class RegionFrame(Frame):
    """One forward run of a region: its tape, and the saved tensors autograd holds handles for."""

    __slots__ = (
        "captures", "claimed", "copies", "freed", "freed_bytes", "kept", "offload", "ops", "recorder", "tape",
    )

    def __init__(
        self, site: str, check: bool, preserve_rng: bool, debug: bool, policy: Policy | None = None
    ) -> None:
        super().__init__(site, check, True, [] if debug else None)
        # Storages of the tensors handles stand for: key (`storage_key`) -> the storage, weakly. A key is an
        # address, reused once its storage is freed; the weak reference tells a new storage from a seen one.
        # The recorder notes writes into these (NOTE [ Replay script ]).
        self.freed: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.recorder: Recorder | None = Recorder(preserve_rng, self.trace, policy, self.freed)
        self.claimed: set[int] = set()  # kept slots (policy) that autograd saves: NOTE [ Policies on the tape ]
        # (handle index, tape slot, op count when saved, the storage's weak reference or None)
        self.captures: list[tuple[int, int, int, weakref.ref[torch.UntypedStorage] | None]] = []
        self.kept: dict[int, tuple[Kept, int]] = {}  # tape slot of an outside tensor -> its token, its version
        self.copies: dict[int, torch.Tensor] | None = {} if debug else None
        self.tape: Tape | None = None
        self.ops = 0
        self.freed_bytes = 0
        self.offload: Offload | None = None  # where what the policy keeps goes: NOTE [ Offloaded sites ]

    # -- forward -------------------------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        """The pack hook: a handle for a tensor the tape made, the tensor itself otherwise."""
        recorder = self.recorder
        if recorder is None:  # pragma: no cover - hooks are popped before the recorder is dropped
            raise RematError(f"remat: region `{self.site}` saved a tensor after it ended; {BUG}.")
        refs, outside = recorder.refs, recorder.outside
        found = refs.get(id(tensor))
        if found is not None and found[0]() is tensor:
            slot = found[1]
            if slot not in outside:
                base = tensor._base
                if base is None and not recorder.kept and self.copies is None:
                    # The common case, `_capture` inlined: one Python call per saved tensor is a visible share
                    # of the hook's cost.
                    handles = self._handles
                    index = len(handles)
                    handle = Handle(index)
                    handles.append(_ref(handle))
                    if self.check:
                        self._metas.append((tensor.shape, tensor.dtype, tensor.device))
                    try:
                        key: int | None = _storage_id(tensor)
                    except (RuntimeError, NotImplementedError, TypeError):
                        key = None
                    storage = self._count_freed(key, tensor) if key is not None else None
                    self.captures.append((index, slot, len(recorder.ops), storage))
                    return handle
                if base is None or (
                    (made := refs.get(id(base))) is not None and made[0]() is base and made[1] not in outside
                ):
                    if recorder.kept:
                        kept_slot = slot if base is None else refs[id(base)][1]
                        output = recorder.kept.get(kept_slot)
                        # not one changed since it was kept: NOTE [ A kept output changed in place ] in kept.py
                        if output is not None and not output.moved():
                            return self._keep_claimed(recorder, tensor, kept_slot)
                    return self._capture(recorder, tensor, slot)
            elif self.outer is None:
                # A tensor from outside that the tape reads, saved again at the same version (a weight used by
                # every step of a loop): autograd may hold one token for all of them.
                kept = self.kept.get(slot)
                if kept is None or kept[1] != tensor._version:
                    kept = self.kept[slot] = (self.keep(tensor), tensor._version)
                return kept[0]
        if self.outer is None:
            return self.keep(tensor)
        recorder.paused = True  # the enclosing pack hook may run ops of its own: not the tape's
        try:
            return self.keep_outside(tensor)
        finally:
            recorder.paused = False

    def _keep_claimed(self, recorder: Recorder, tensor: torch.Tensor, slot: int) -> Kept | Parcel | Stay:
        """A saved tensor that is (a view of) an output the policy keeps: kept by reference, not rebuilt."""
        self.claimed.add(slot)
        recorder.paused = True
        try:
            if self.offload is not None:
                # The kept output itself is the object the tape keeps: one host copy serves both.
                kept = recorder.kept.get(slot) if tensor._base is None else None
                return self.offload.pack(kept.value if kept is not None else tensor.detach())
            # detached: an op may save its own output; held by autograd's token with its kept output, which the tape
            # holds weakly (NOTE [ Policies on the tape ] in tape.py, rule 3)
            return self.keep_held(tensor.detach(), recorder.kept.get(slot))
        finally:
            recorder.paused = False

    def _capture(self, recorder: Recorder, tensor: torch.Tensor, slot: int) -> Handle:
        """A handle for a tensor the tape made (tape slot `slot`), rebuilt by replay."""
        handle = self.handle(tensor)
        key = storage_key(tensor)
        storage = self._count_freed(key, tensor) if key is not None else None
        self.captures.append((handle.index, slot, len(recorder.ops), storage))
        if self.copies is not None:
            self._copy(recorder, handle.index, tensor)
        return handle

    def _count_freed(self, key: int, tensor: torch.Tensor) -> weakref.ref[torch.UntypedStorage]:
        """Count the storage under `key` unless it was counted (a key is reused once its storage dies).

        Returns the storage's weak reference: one object per storage, so that it also identifies a storage that
        has died (NOTE [ Replay script ]).
        """
        seen = self.freed.get(key)
        if seen is None or seen() is None:
            storage = tensor.untyped_storage()
            seen = self.freed[key] = weakref.ref(storage)
            self.freed_bytes += storage.nbytes()
        return seen

    def _copy(self, recorder: Recorder, index: int, tensor: torch.Tensor) -> None:
        assert self.copies is not None
        recorder.paused = True
        try:
            self.copies[index] = tensor.detach().clone()
        finally:
            recorder.paused = False

    def finish(self) -> None:
        """End of forward: keep the tape for the saved tensors still alive, drop everything else."""
        recorder = self.recorder
        assert recorder is not None
        self.recorder = None
        self.ops = len(recorder.ops)
        self.freed = {}
        self.kept = {}
        self.close()
        alive = self._alive()
        self.captures = []
        recorder.refs = {}
        if not alive:
            return
        self.tape = Tape(recorder, alive, self.site, frozenset(self.claimed))
        if self.offload is not None:
            self.tape.offload_kept(self.offload.pack)
        else:
            self.tape.hold_claimed_weakly()
        if self.outer is not None:
            self.tape.hand_to(self.outer[0])

    def _alive(self) -> list[tuple[int, int, int, weakref.ref[torch.UntypedStorage] | None]]:
        """The captures whose handle autograd still holds."""
        return [
            capture for capture in self.captures
            if (ref := self._handles[capture[0]]) is not None and ref() is not None
        ]

    # -- backward ------------------------------------------------------------------------------------------
    def recompute(self, wanted: set[int], store: dict[int, torch.Tensor]) -> None:
        """Replay the tape up to the last op that `wanted` needs and put those tensors into `store`."""
        tape = self.tape
        recorder = self.recorder
        if tape is None and recorder is not None:  # forward still runs: NOTE [ Backward inside a site ]
            tape = Tape(recorder, self._alive(), self.site, frozenset(self.claimed), final=False)
        if tape is None:
            raise RecomputeMismatchError(f"remat: region `{self.site}` has no tape to replay; {BUG}.")
        copies = self.copies

        def emit(index: int, tensor: torch.Tensor) -> None:
            self.expect(index, tensor)
            if copies is not None:
                self._compare(tape, index, tensor, copies[index])
            store[index] = tensor.detach() if tensor.requires_grad else tensor

        self.retrace = [] if self.trace is not None else None
        # While forward runs, its recorder is paused like every other (NOTE [ Recompute is not recorded ]).
        tape.replay(wanted, emit, None if self.outer is None or recorder is not None else self.outer[1], self.retrace)

    def _compare(self, tape: Tape, index: int, tensor: torch.Tensor, forward: torch.Tensor) -> None:
        try:
            torch.testing.assert_close(tensor.detach(), forward, equal_nan=True)
        except AssertionError as error:
            slot = next(slot for handle, slot, _, _ in tape.captures if handle == index)
            op = max(i for i, entry in enumerate(tape.ops) if entry[3] <= slot)
            func, _, _, first, _, _ = tape.ops[op]
            detail = str(error).strip().splitlines()[0]
            raise RecomputeMismatchError(
                _VALUES_DIFFER.format(
                    site=self.site, index=index, output=slot - first, op=op, name=op_info(func).name,
                    detail=detail,
                )
            ) from None


# NOTE [ Region entry ]
# 1. A region records only when grad mode is on: without it autograd saves nothing, so there is nothing to free.
# 2. Its exit undoes its entry in reverse order, also when the block raised (then the recording is dropped).
#
# Implementation notes:
# 1. (rule 2) `begin_replay` pushes the recording mode and then the saved-tensor hooks; `end_replay` pops them and
#    finishes the tape. The `Region` of `remat.region()` (below) calls them.


def begin_replay(
    *, site: str, check: bool = True, preserve_rng: bool = True, debug: bool = False, module: nn.Module | None = None,
    offload: Offload | None = None, policy: Policy | None = None,
) -> object:
    """Start recording a replay region; the code between `begin_replay` and `end_replay` runs inside it.

    Args:
        site: the name used in errors.
        check: compare shape, dtype and device of rebuilt tensors with forward's.
        preserve_rng: replay random ops with the generator states forward used.
        debug: also keep a copy of each freed tensor and compare rebuilt values (REMAT_DEBUG=1).
        module: accepted for symmetry with the rerun strategy; the tape finds devices itself.
        offload: keep the tensors from outside that the region keeps on the host (NOTE [ Offloaded sites ]).
        policy: what to keep from forward instead of replaying (None: nothing; NOTE [ Policies on the tape ]).

    Returns:
        A token for `end_replay` (None when nothing is recorded: grad mode is off).

    >>> x = torch.ones(3, requires_grad=True)
    >>> token = begin_replay(site="demo", check=True, preserve_rng=True, debug=False)
    >>> y = x.sin().sin()
    >>> end_replay(token)
    >>> y.sum().backward()
    """
    del module
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return None
    if policy is not None and (policy.everything or policy.saves_nothing):
        if policy.everything:
            return None  # save_all: every activation is kept, nothing to record
        policy = None
    frame = RegionFrame(site, check, preserve_rng, debug, policy)
    if offload is not None and frame.outer is None:  # see NOTE [ Offloaded sites ] in offload.py
        frame.outer = offload.hooks
    frame.offload = for_kept(offload, policy)
    recorder = frame.recorder
    assert recorder is not None
    recorder.__enter__()  # type: ignore[no-untyped-call]
    try:
        push_saved_hooks(frame.pack, frame.unpack)
    except BaseException:
        recorder.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        raise
    recording().append(recorder)
    if policy is not None and policy.names:
        tags.sinks.append(recorder.keep_tagged)
    return frame


def end_replay(token: object, *, ok: bool = True) -> None:
    """Stop the recording `begin_replay` started; with `ok=False` (the block raised) just drop it.

    >>> end_replay(None)  # a token of a region that recorded nothing
    """
    if token is None:
        return
    if not isinstance(token, RegionFrame) or token.recorder is None:
        raise RematError(f"remat: `end_replay` got {token!r}, which is not an open region token; {BUG}.")
    recorder = token.recorder
    if recorder.policy is not None and recorder.policy.names:
        tags.sinks.pop()
    stack = recording()
    for index in range(len(stack) - 1, -1, -1):  # the last one but for regions left out of order
        if stack[index] is recorder:
            del stack[index]
            break
    try:
        pop_saved_hooks()
    finally:
        recorder.__exit__(None, None, None)  # type: ignore[no-untyped-call]
    if ok:
        token.finish()
    else:
        token.recorder = None
        token.close()


# The object `remat.region()` returns: a block of code, or each call of a decorated function, run as a replay
# region through `region.begin_replay` and `region.end_replay`.
#
# A `Region` keeps the recordings it has open in a thread-local stack, so one object may be entered again while it
# is open (a recursive decorated function: each level is a nested region) and from several threads at once; `ops`
# and `freed_bytes` describe the recording that ended last.

_F = TypeVar("_F", bound=Callable[..., Any])


class Region:
    """Rematerialize every activation of a block by replaying the aten ops it ran.

    Used as `with remat.region() as r:` or as a decorator, `@remat.region()`. Inside, autograd keeps handles
    instead of the activations made in the block; backward replays the recorded ops to rebuild them. Tensors
    created before the block are kept by reference. The block runs untouched when the site is off
    (`enabled=False`, or `REMAT=0`) or when grad mode is off.

    Attributes:
        ops: number of aten ops recorded by the recording that ended last.
        freed_bytes: bytes of saved activations that it does not keep (rebuilt in backward).

    Args:
        options: the site's options; `strategy` is ignored (a region always replays).

    >>> import torch
    >>> from remat._core.options import Options
    >>> x = torch.randn(4, 4, requires_grad=True)
    >>> with Region(Options()) as r:
    ...     y = x.tanh().exp()
    >>> y.sum().backward()
    >>> r.ops, r.freed_bytes
    (2, 128)
    """

    def __init__(self, options: Options) -> None:
        self.options = options
        self.ops = 0
        self.freed_bytes = 0
        self._local = threading.local()

    def _stack(self) -> list[object]:
        stack: list[object] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _begin(self, site: str | None) -> None:
        options = self.options
        token = None
        if options.active(_switch.is_enabled()):
            if in_compiled_call():
                _warn_compiled_block()
            if site is None:
                caller = sys._getframe(2)
                site = f"region at {caller.f_code.co_filename}:{caller.f_lineno}"
            token = begin_replay(
                site=site, check=options.check, preserve_rng=options.preserve_rng,
                debug=options.debug or _switch.debug(), offload=resolve(options.offload),
                policy=as_policy(options.policy),
            )
        self._stack().append(token)

    def _end(self, ok: bool) -> None:
        token = self._stack().pop()
        end_replay(token, ok=ok)
        if ok and isinstance(token, RegionFrame):
            self.ops, self.freed_bytes = token.ops, token.freed_bytes

    def __enter__(self) -> Region:
        self._begin(self.options.name)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._end(exc_type is None)

    def __call__(self, fn: _F) -> _F:
        """Decorate a function or method: each call runs as a fresh region."""
        site = self.options.name or getattr(fn, "__qualname__", None) or repr(fn)
        check_runs_when_called(fn, site)

        options = self.options
        context_fn = context_for(as_policy(options.policy), site, options.offload is not False)
        key = compiled_key(as_policy(options.policy))

        @functools.wraps(fn)
        def region(*args: Any, **kwargs: Any) -> Any:
            if compiling() and options.active(_switch.is_enabled()) and torch.is_grad_enabled():
                # see NOTE [ Under torch.compile ]
                return torch_checkpoint(fn, args, kwargs, key=key, context_fn=context_fn)
            self._begin(site)
            try:
                out = fn(*args, **kwargs)
            except BaseException:
                self._end(False)
                raise
            self._end(True)
            return out

        return region  # type: ignore[return-value]


def _warn_compiled_block() -> None:
    """Say once that a region in compiled code is not compiled (dynamo's graph break)."""
    warn_once("region block", (
        "remat: a `with remat.region():` block inside torch.compile'd code breaks the graph: dynamo runs the "
        "function holding it in eager code (rematerialized there, not compiled). To compile the block with its "
        "activations recomputed, move it into a function decorated with `@remat` or `@remat.region()`."
    ), stacklevel=5)

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
