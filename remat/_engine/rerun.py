"""The rerun strategy: forward runs the function under saved-tensor hooks; backward calls it again.

See NOTE [ Handle lifetime ] and NOTE [ Inputs of nested sites ] in hooks.py for what the hooks keep.
"""

from __future__ import annotations

import dis
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn

from .._core.errors import RecomputeMismatchError, RematError
from .._core.policies import Policy, tags
from .._core.torch_compat import any_autocast, pop_saved_hooks, push_saved_hooks, set_grad_enabled, version_of
from .autocast import AutocastState
from .debug import OpTrace
from .guard import BufferVersions, buffer_versions, guard_buffers, release, saved_in_recompute, stale_read
from .hints import Attributes, attributes, explain
from .hooks import Frame, Handle, Kept, Outer, StopRecompute
from .kept import KeptOutput, keep_output
from .offload import Offload, for_kept, no_offload_inside
from .rng import Draw, RngStash, devices_of
from .selective import KeptCall, ReuseOps, SaveOps, held_by_autograd
from .transfer import Parcel, Stay
from .tree import map_tensors, tensors_in

__all__ = ["RerunFrame", "begin", "call", "end"]


_frame = sys._getframe

# NOTE [ Recompute state ]
# Rules:
# 1. Recompute runs the function under forward's RNG state, set and then the caller's put back (a fork), with grad
#    enabled (so autograd saves, and the pack hook sees, what forward saved), and under `guard_buffers` (NOTE
#    [ Writes during recompute ]).
# 2. Autocast, the user's recompute context, the policy and debug traces are entered only where a site has them.
# 3. A module's recompute runs it with the parameters it has then: NOTE [ Parameters in recompute ] in hooks.py.
# 4. A module that was in training mode in forward and is in eval mode at backward (`model.eval()` between them),
#    or the other way round, would be recomputed in the other mode, where dropout, BatchNorm and any
#    `if self.training:` branch compute other values, some without a sign (an op that saves nothing): the
#    recompute raises `RecomputeMismatchError` saying so before it runs. Forward notes the site module's own flag.
#
# Implementation notes:
# 1. (rule 2) The common path sets three things and restores three, with no context-manager machinery: it runs
#    once per site in every backward.
#
# NOTE [ Early stop ]  (for users: the docs' design page, "Early stop")
# Rules:
# 1. With early stop on (the default), recompute stops right after the last tensor backward wants has been packed:
#    none of the user's code after that point runs again, also where forward saved nothing after it (a trailing
#    `clone`, a log call, a counter), as torch's checkpoint stops. What comes after is neither checked nor kept.
# 2. With it off, the function runs to its end and recompute must save exactly as many tensors as forward did: a
#    different count is a mismatch, except while forward is still running (NOTE [ Backward inside a site ] in
#    hooks.py), where only the part that has run can be compared.
# 3. What decides the outcome is only what was saved, never how long anything took.
#
# Implementation notes:
# 1. (rule 1) The pack hook raises `StopRecompute`; where the function has nothing left to do but return, the
#    raise (which unwinds through autograd's C++) is skipped: NOTE [ Stopping without raising ] below.

# NOTE [ Recompute saves nothing ]
# Rules:
# 1. The recompute pack hook collects the tensors forward's graph needs and gives autograd nothing to keep (None),
#    also under `create_graph=True`: the graph recompute builds is never run backward.
# 2. The unpack hook returns only the data of a saved tensor; autograd attaches forward's grad_fn to it, so a
#    double backward goes through forward's graph.
# 3. The exception: a site whose function runs backward itself (`Frame.inner`, NOTE [ Backward inside a site ])
#    runs that backward over the graph recompute builds, which needs its saved tensors. The hook gives autograd
#    each one, as torch does: the tensor itself where forward kept or handed it over (an input, a parameter, a view
#    of one: its grad_fn, if any, is not of this graph), else detached; the store keeps that same detached tensor.
#
# Implementation notes:
# 1. (rules 1, 3) Anything else makes a cycle through C++ for every op that saves its own output (exp, tanh,
#    sigmoid: tensor -> grad_fn -> saved variable -> tensor), which holds the recompute graph, and through it the
#    site's inputs and their AccumulateGrad nodes, for good; a detached tensor has no grad_fn, so no store entry
#    holds the recompute graph.

_MODE_CHANGED = (
    "remat: `{site}` ran in {then} mode in forward and is in {mode} mode now, in backward (`model.{now}()` between "
    "them): rerun would recompute it in {mode} mode, where dropout, BatchNorm and any `if self.training:` branch "
    "compute other values than forward did, and give wrong gradients. Switch modes after backward, or use "
    "strategy='replay', which replays forward's ops."
)
_INPLACE_INPUT = (
    "remat: one of the variables needed for gradient computation has been modified by an inplace "
    "operation: input tensor #{index} of `{site}` was at version {before} when forward started and is at "
    "version {after} now. Rerun would call the function on the modified value and give wrong gradients. "
    "Don't modify the inputs of a remat site in place (inside it or between forward and backward), or use "
    "strategy='replay'."
)


class RerunFrame(Frame):
    """One forward call of a rerun site: the function, its inputs, and the state to call it again in."""

    __slots__ = (
        "args", "attrs", "autocast", "buffers", "changed", "claimed", "contexts", "devices", "draws", "exit", "fn",
        "ids", "kept", "kept_ids", "kept_tags", "kwargs", "live", "module", "offload", "policy", "rng", "saver",
        "tensors", "training", "versions",
    )

    fn: Callable[..., Any]
    args: Any
    kwargs: Any
    live: tuple[Any, Any] | None  # the call's own arguments while forward runs, when `args` were handed over
    tensors: list[torch.Tensor]
    versions: list[int]
    ids: set[int]
    devices: tuple[torch.device, ...]
    rng: RngStash | None
    autocast: AutocastState | None
    contexts: Callable[[], AbstractContextManager[Any]] | None
    exit: ExitStack | None
    module: nn.Module | None  # the module whose forward runs, for its buffers: NOTE [ Writes during recompute ]
    training: bool  # the module's mode in forward: NOTE [ Recompute state ], rule 4
    # the module's buffers' versions while forward runs, then those it changed in place (NOTE [ Buffers read before
    # forward changed them ] in guard.py)
    buffers: BufferVersions | None
    changed: frozenset[int]
    policy: Policy | None
    saver: SaveOps | None  # forward's notes of the policy's ops (NOTE [ What a policy keeps ])
    kept: list[KeptCall]  # per call of a policy op, its kept outputs (`KeptCall`); after forward
    claimed: set[int]  # the calls in `kept` whose outputs autograd saves
    draws: dict[int, Draw]  # the calls in `kept` that drew random numbers: their generator's state after them
    # tensors kept through `remat.tag`, by id: the tensor (weakly) and what keeps it
    kept_ids: dict[int, tuple[weakref.ref[torch.Tensor], KeptOutput]]
    # tensors kept through `remat.tag`, detached (or offloaded), in order (None once dropped: NOTE [ A kept output
    # changed in place ] in kept.py)
    kept_tags: list[KeptOutput | None]
    offload: Offload | None  # where what the policy keeps goes: NOTE [ Offloaded sites ] in offload.py
    attrs: Attributes | None  # the module's Python attributes before recompute: NOTE [ Mismatch hints ]

    def hint(self) -> str:
        """A cache among the arguments, attributes the module changed: see NOTE [ Mismatch hints ]."""
        return explain(self.args, self.kwargs, self.module, getattr(self, "attrs", None))

    def pack(self, tensor: torch.Tensor) -> Kept | Handle | Outer | Parcel | Stay:
        """The forward pack hook: inputs, leaf parameters and views of them are kept, the rest rebuilt."""
        if id(tensor) in self.ids:
            return self.keep_outside(tensor)
        if tensor.requires_grad and tensor.is_leaf:  # never `grad_fn`: see NOTE [ Freeing long chains ]
            return self.keep(tensor)
        owner = self._kept_by_policy(tensor) if self.policy is not None else None
        if owner is not None:
            if self.offload is not None:
                self.account(tensor)
                return self.offload.pack(tensor)
            # detached: an op may save its own output; held by autograd's token, with what recompute would hand
            # back, and no longer (NOTE [ What a policy keeps ] in selective.py, rule 2)
            return self.keep_held(tensor.detach(), owner)
        base = tensor._base
        if base is not None:
            if id(base) in self.ids:
                return self.keep_outside(tensor)
            if base.requires_grad and base.is_leaf:
                return self.keep(tensor)
        return self.handle(tensor)

    def _kept_by_policy(self, tensor: torch.Tensor) -> KeptOutput | None:
        """The kept output whose memory `tensor` lies in, if the policy keeps it; else None (rebuilt)."""
        found = self.kept_ids.get(id(tensor))
        if found is not None and found[0]() is tensor:
            # changed since it was tagged: rebuilt (NOTE [ A kept output changed in place ] in kept.py)
            return None if found[1].moved() else found[1]
        return self.saver.claim(tensor) if self.saver is not None else None

    def keep_tagged(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Forward's `remat.tag`: keep `tensor` when the policy saves `name`."""
        if self.policy is not None and self.policy.saves_name(name):
            # detached: no cycle through forward's graph; offloaded at once, as the tensor autograd saves; with its
            # version (NOTE [ A kept output changed in place ] in kept.py)
            kept = keep_output(tensor, None if self.offload is None else self.offload.pack)
            self.kept_tags.append(kept)
            self.kept_ids[id(tensor)] = (weakref.ref(tensor), kept)
        return tensor

    def _inputs(self) -> tuple[Any, Any]:
        if self.outer is not None and self.live is None:
            unpack = self.outer[1]

            def fetch(outer: Outer) -> torch.Tensor:
                # Enclosing hooks may hand back a tensor that needs no grad (`save_on_cpu`, an outer store
                # filled under no_grad); recompute must see forward's requires_grad, or autograd would save
                # fewer tensors than forward did.
                tensor = unpack(outer.packed)
                if outer.requires_grad and not tensor.requires_grad:
                    tensor = tensor.detach().requires_grad_()
                return tensor

            return map_tensors(self.args, fetch, Outer), map_tensors(self.kwargs, fetch, Outer)
        if _versions(self.tensors) != self.versions:
            for index, (tensor, before) in enumerate(zip(self.tensors, self.versions, strict=True)):
                if version_of(tensor) != before:
                    raise RematError(
                        _INPLACE_INPUT.format(index=index, site=self.site, before=before, after=tensor._version)
                    )
        return self.live or (self.args, self.kwargs)

    def recompute(self, wanted: set[int], store: dict[int, torch.Tensor]) -> None:
        """Call the function again under hooks that collect the saved tensors in `wanted`."""
        args, kwargs = self._inputs()
        if self.module is not None and self.module.training != self.training:
            raise RecomputeMismatchError(_MODE_CHANGED.format(
                site=self.site, then="training" if self.training else "eval", now="eval" if self.training else "train",
                mode="training" if self.module.training else "eval"))
        self.attrs = attributes(self.module) if self.module is not None else None
        collector = _Collector(self, wanted, store, args, kwargs)
        # See NOTE [ Recompute state ].
        caller_rng = self.rng.swap_in() if self.rng is not None else None
        grad_was = torch.is_grad_enabled()
        set_grad_enabled(True)
        extra = (
            recompute_contexts(self)
            if self.autocast is not None or self.contexts is not None or self.policy is not None
            or self.trace is not None or self.saver is not None or any_autocast()
            else None
        )
        guard = guard_buffers(self.module, self.changed)
        push_saved_hooks(collector.pack, _identity)
        try:
            self._call_again(collector, args, kwargs)
        finally:
            pop_saved_hooks()
            collector.close()
            stale = release(guard)
            if extra is not None:
                extra.close()
            set_grad_enabled(grad_was)
            if caller_rng is not None:
                caller_rng.apply()
        if stale is not None:  # NOTE [ Buffers read before forward changed them ] in guard.py
            raise stale_read(self.site, stale)
        self.attrs = None  # recompute went well: only a mismatch reads it (NOTE [ Mismatch hints ])

    def _call_again(self, collector: _Collector, args: Any, kwargs: Any) -> None:
        """Run the function under the collector's hook; raise a mismatch where recompute parted from forward."""
        stopped = False
        try:
            self.fn(*args, **kwargs)
        except StopRecompute:
            stopped = True  # never once the collector parted: it stops checking then
        except Exception:
            if not collector.parted:
                raise
        if collector.parted:
            raise self.mismatch(*collector.parted)
        count, limit = collector.count, collector.limit
        if not stopped and ((limit < 0 and self.check and count < self.saved) or count <= limit):
            raise self.mismatch(count, None, "recompute saved fewer tensors than forward did")


class _Collector:
    """Recompute's pack hook: checks each saved tensor against forward's, stores those backward wants, and stops
    the function right after the last of them (NOTE [ Early stop ]); see NOTE [ Recompute saves nothing ] for what
    it gives autograd."""

    __slots__ = ("count", "defer", "given", "inner", "limit", "live", "parted", "stop", "wanted")

    def __init__(
        self, frame: RerunFrame, wanted: set[int], store: dict[int, torch.Tensor], args: Any, kwargs: Any
    ) -> None:
        self.wanted = wanted
        # See NOTE [ Early stop ]: tolerate what comes after `limit`; raise out at `stop`.
        self.limit = self.stop = -1
        if frame.early_stop or frame.open:
            self.limit = max(wanted)
            if frame.early_stop:
                self.stop = self.limit
        self.count = 0
        # Under debug traces a mismatch is raised once the function has run to its end, so that the trace shows
        # every op recompute ran, also those after the point where it parted from forward.
        self.parted: list[Any] = []
        self.defer = frame.trace is not None
        # The function runs backward over what recompute saves: NOTE [ Recompute saves nothing ] and NOTE
        # [ Backward inside a site ] in hooks.py (what forward keeps or hands over is kept as itself).
        self.inner = frame.inner
        self.given = set(map(id, tensors_in(kwargs, tensors_in(args, [])))) if frame.inner else set()
        # The recompute graph keeps `pack` alive through its saved tensors (autograd holds both hooks), and the
        # store holds tensors of that graph: the hook reaches the frame and the store only through `live`, emptied
        # when recompute ends (`close`), or they would form a cycle through C++ that gc can't see.
        self.live: list[Any] = [frame, store]

    def close(self) -> None:
        self.live.clear()

    def _to_keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """What autograd keeps of a tensor the function saves while it runs backward itself."""
        given = self.given
        if id(tensor) in given or (tensor.requires_grad and tensor.is_leaf):
            return tensor
        base = tensor._base
        if base is not None and (id(base) in given or (base.requires_grad and base.is_leaf)):
            return tensor
        return tensor.detach()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | None:
        frame, found = self.live
        saved_in_recompute(tensor)
        index = self.count
        self.count = index + 1
        kept = self._to_keep(tensor) if self.inner else None
        if index > self.limit >= 0 or self.parted:
            return kept
        if self.defer:
            what = frame.differs(index, tensor)
            if what is not None:
                self.parted.extend((index, tensor.detach(), what))  # detached: no cycle through the hook
                return kept
        else:
            frame.expect(index, tensor)
        if index in self.wanted:
            found[index] = tensor if kept is None else kept
        if index == self.stop and not returns_at_once(_frame(1), _RECOMPUTE):  # NOTE [ Stopping without raising ]
            raise StopRecompute
        return kept


_RECOMPUTE = RerunFrame._call_again.__code__  # the frame the function is called from: see `returns_at_once`
no_offload_inside(RerunFrame)  # an offload block inside the function would take what recompute rebuilds


_UNCHANGED: frozenset[int] = frozenset()


def _versions(tensors: list[torch.Tensor]) -> list[int]:
    """The version of each tensor (`version_of`: -1 for an inference tensor), at the cost of one list of ints."""
    try:
        return [tensor._version for tensor in tensors]
    except RuntimeError:  # an inference tensor among them
        return [version_of(tensor) for tensor in tensors]


def _identity(packed: Any) -> Any:
    return packed


_Contexts = tuple[
    Callable[[], AbstractContextManager[Any]], Callable[[], AbstractContextManager[Any]]
]


def begin(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    site: str,
    check: bool = True,
    preserve_rng: bool = True,
    early_stop: bool = True,
    debug: bool = False,
    module: nn.Module | None = None,
    contexts: _Contexts | None = None,
    policy: Policy | None = None,
    offload: Offload | None = None,
) -> RerunFrame:
    """Open a rerun region for the call `fn(*args, **kwargs)` that the caller makes next; see `call`."""
    # On the path of every call: the common case (no enclosing hooks, no offload, no policy) first.
    tensors = tensors_in(args, [])
    if kwargs:
        tensors_in(kwargs, tensors)
    frame = RerunFrame(site, check, early_stop, [] if debug else None)
    frame.fn = fn
    frame.module = module
    frame.training = module is not None and module.training
    frame.buffers, frame.changed = None if module is None else buffer_versions(module), _UNCHANGED
    frame.policy = policy
    frame.exit = frame.saver = frame.offload = frame.contexts = None
    if offload is not None or policy is not None:
        if offload is not None and frame.outer is None:  # see NOTE [ Offloaded sites ] in offload.py
            frame.outer = offload.hooks
        frame.offload = for_kept(offload, policy)
    frame.tensors, frame.versions = tensors, _versions(tensors)
    if frame.outer is None:
        frame.args, frame.kwargs, frame.live = args, kwargs, None
    else:
        frame.args, frame.kwargs = map_tensors(args, frame.hand_over), map_tensors(kwargs, frame.hand_over)
        frame.live = (args, kwargs)  # until forward ends: NOTE [ Backward inside a site ] in hooks.py
    frame.ids = {id(tensor) for tensor in tensors}
    if preserve_rng:
        devices = frame.devices = devices_of(tensors, module)
        frame.rng = RngStash.capture(devices)
    else:
        devices = frame.devices = ()
        frame.rng = None
    frame.autocast = AutocastState.capture(devices)
    if contexts is not None:
        frame.contexts = contexts[1]
    if policy is not None:
        frame.kept, frame.claimed, frame.kept_ids, frame.kept_tags, frame.draws = [], set(), {}, [], {}
    if contexts is not None or frame.trace is not None or policy is not None:
        frame.exit = ExitStack()
        if contexts is not None:
            frame.exit.enter_context(contexts[0]())
        if frame.trace is not None:
            frame.exit.enter_context(OpTrace(frame.trace))
        if policy is not None:
            if policy.ops:
                pack = None if frame.offload is None else frame.offload.pack
                frame.saver = frame.exit.enter_context(SaveOps(policy, pack, rng=preserve_rng))
            if policy.names:
                frame.exit.enter_context(tag_sink(frame.keep_tagged))
    push_saved_hooks(frame.pack, frame.unpack)
    return frame


def end(frame: RerunFrame, *, ok: bool = True) -> None:
    """Close the region `begin` opened; `ok=False` after an exception (nothing differs for rerun)."""
    pop_saved_hooks()
    frame.open = False
    if frame.buffers is not None:
        frame.changed, frame.buffers = frame.buffers.changed(), None
    if frame.live is not None:  # handed over to the enclosing hooks: hold none of them any more
        frame.close()
        frame.live, frame.tensors, frame.versions = None, [], []
    if frame.exit is not None:
        frame.exit.close()
        frame.exit = None
    if frame.saver is not None:
        outputs, frame.claimed, frame.draws = frame.saver.finish()
        # what autograd saves lives in autograd's tokens (NOTE [ What a policy keeps ] in selective.py, rule 2); an
        # offloaded site's in host memory, kept as before
        frame.kept = held_by_autograd(outputs, frame.claimed) if frame.offload is None else list(outputs)
        frame.saver = None
    if frame.policy is not None and frame.kept_tags:
        # a tagged tensor changed since: nothing to hand back (NOTE [ A kept output changed in place ] in kept.py)
        tags = frame.kept_tags
        for index, kept in enumerate(tags):
            if kept is not None and kept.moved():
                tags[index] = None


def call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], **options: Any) -> Any:
    """Run `fn(*args, **kwargs)` as a rerun region and return its output.

    `options` are those of `begin`: `site` (the name used in errors) and the keyword arguments after it.

    >>> x = torch.ones(3, requires_grad=True)
    >>> call(torch.sin, (x,), {}, site="sin").sum().backward()
    """
    frame = begin(fn, args, kwargs, **options)
    try:
        return fn(*args, **kwargs)
    finally:
        end(frame)


# The rarer parts of a rerun recompute's state, entered only when a site has any of them (NOTE [ Recompute state ]).


def recompute_contexts(self: RerunFrame) -> ExitStack:
    """The rarer recompute state: autocast, the user's recompute context, the policy, debug traces."""
    stack = ExitStack()
    stack.enter_context(AutocastState.enter(self.autocast, self.devices))
    if self.saver is not None:  # forward still runs (NOTE [ Backward inside a site ]): not its policy ops
        stack.enter_context(_unnoted(self.saver))
    if self.contexts is not None:
        stack.enter_context(self.contexts())
    if self.policy is not None:
        unpack = None if self.offload is None else self.offload.unpack_one
        if self.kept:
            stack.enter_context(ReuseOps(self.policy, self.kept, self.claimed, unpack, self.draws, self.site))
        if self.inner and self.policy.names:
            # The function runs backward through what it tagged: a kept tensor put in its place would cut
            # that graph, so recompute rebuilds it (and forward's sink, if forward still runs, is not fed).
            stack.enter_context(tag_sink(_as_is))
        elif self.kept_tags:
            kept_tags = iter(self.kept_tags)
            policy = self.policy

            def hand_back(tensor: torch.Tensor, name: str) -> torch.Tensor:
                if not policy.saves_name(name):
                    return tensor
                kept = next(kept_tags, None)
                if kept is None or kept.moved():  # changed in place since it was tagged: what recompute rebuilt
                    return tensor
                value: torch.Tensor = kept.value if unpack is None else unpack(kept.value)
                return value.detach().requires_grad_(tensor.requires_grad)

            stack.enter_context(tag_sink(hand_back))
    if self.trace is not None:
        self.retrace = []
        stack.enter_context(OpTrace(self.retrace))
    return stack


def _never(func: Any) -> bool:
    return False


def _as_is(tensor: torch.Tensor, name: str) -> torch.Tensor:
    return tensor


@contextmanager
def _unnoted(saver: SaveOps) -> Iterator[None]:
    """Keep forward's `saver` from noting the ops of a recompute run while forward is still running."""
    saves_op, saver.saves_op = saver.saves_op, _never
    try:
        yield
    finally:
        saver.saves_op = saves_op


@contextmanager
def tag_sink(sink: Callable[[torch.Tensor, str], torch.Tensor]) -> Iterator[None]:
    """Route `remat.tag` calls to `sink` while the block runs (see NOTE [ Policies ])."""
    tags.sinks.append(sink)
    try:
        yield
    finally:
        tags.sinks.pop()


# Whether any Python code still runs after the op in progress: what lets early stop skip raising.
#
# NOTE [ Stopping without raising ]
# 1. Early stop keeps the function's code after the last needed tensor from running (NOTE [ Early stop ]); it raises
#    out of the pack hook only where some of the user's code would otherwise run.
# 2. The decision depends on the bytecode only, never on timing.
#
# Implementation notes:
# 1. (rule 1) Raising unwinds through autograd's C++, which costs more than the rest of a small site's overhead
#    (docs/benchmarks.md). Where the op that saved the tensor is the last thing each Python frame between it and
#    recompute does before returning (`return (x * 2).sin()`), nothing runs after it. A frame qualifies when the
#    instruction after its current call is RETURN_VALUE; anything else (a store, another call, a `with` block's exit,
#    a `finally` body, a comprehension's append) raises.
# 2. (rule 2) The answer is cached per (code, instruction).

_RETURNS: dict[tuple[CodeType, int], bool] = {}
_RETURNS_KEPT = 4096
_LOCK = threading.Lock()


def _returns_after(code: CodeType, offset: int) -> bool:
    key = (code, offset)
    found = _RETURNS.get(key)
    if found is None:
        # The frame's offset is its call instruction's, or, while it calls Python code, that of the call's last
        # inline cache entry: the instruction after the call is the first one that starts beyond it.
        following = next((i for i in dis.get_instructions(code) if i.offset > offset), None)
        found = following is not None and following.opname == "RETURN_VALUE"
        with _LOCK:
            if len(_RETURNS) >= _RETURNS_KEPT:
                _RETURNS.clear()
            _RETURNS[key] = found
    return found


def returns_at_once(frame: FrameType | None, top: CodeType) -> bool:
    """Whether every frame from `frame` up to the nearest frame running `top` (not included) returns as soon as
    its current call does. The caller names its own frame by its code: holding a frame object would keep its
    locals alive in a cycle.

    >>> import sys
    >>> def last(): return returns_at_once(sys._getframe(), run.__code__)
    >>> def plain(): return last()
    >>> def busy(): out = last(); return out
    >>> def run(middle): return middle()
    >>> run(plain), run(busy)  # `busy` stores the result before it returns
    (True, False)
    """
    while frame is not None and frame.f_code is not top:
        if not _returns_after(frame.f_code, frame.f_lasti):
            return False
        frame = frame.f_back
    return frame is not None
