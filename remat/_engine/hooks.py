"""Saved-tensor hooks shared by both strategies: handles, per-backward stores, early stop, checks.

See NOTE [ Handle lifetime ] and NOTE [ One store per backward ].
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import Parameter

from .._core.errors import BUG, RecomputeMismatchError, RematError
from .._core.torch_compat import graph_exec_group, graph_task_id, top_saved_hooks
from . import recorder as _recording
from . import stats as _stats
from .mismatch import Meta, mismatch_message
from .transfer import Parcel, Stay

__all__ = ["Frame", "Handle", "Kept", "Outer", "StopRecompute", "mismatch_message"]

# NOTE [ Handle lifetime ]
# 1. In forward the pack hook gives autograd a `Handle` (an index) for an activation made inside the region; tensors
#    from outside (inputs, parameters, views of them) are returned as they are, since keeping them costs nothing.
# 2. A handle lives exactly as long as the graph node that saved it: after a node ran or after the graph was dropped,
#    its slot is no longer rebuilt, and when the last handle goes the frame goes with it.
# 3. Every pack call, kept or not, takes the next index, so forward and recompute count saved tensors the same way.
#
# Implementation notes:
# 1. (rule 2) The frame holds each handle only weakly.
#
# NOTE [ One store per backward ]
# 1. The first unpack in a backward rebuilds every handle still alive and not yet rebuilt, and stops as soon as the
#    highest of them is back (early stop).
# 2. Two backwards over one graph (`retain_graph=True`, or two threads) never share rebuilt tensors.
# 3. A rebuilt tensor lives only until the node that needs it has run; what a backward leaves unread (nodes that
#    `autograd.grad(inputs=...)` skipped) goes when that backward ends.
# 4. Under torch's `torch.utils.checkpoint.GraphExecGroup` the backwards of one group share one recompute, and what
#    is left stays until the frame goes (as in torch).
#
# Implementation notes:
# 1. (rules 2, 4) Rebuilt tensors wait in a store keyed by the graph task, or by the group under rule 4.
# 2. (rule 3) Each tensor is popped on its unpack and an emptied store goes at once; where more than one tensor was
#    rebuilt, a callback queued on the autograd engine drops what is left when the backward ends.
#
# NOTE [ Backward inside a site ]
# The function of a site may itself run backward (`autograd.grad`, `.backward()`, with or without
# `create_graph=True`: a gradient penalty, a MAML inner step). Autograd runs that backward under the saved-tensor
# hooks that were on top when it started, so the graph it reads was packed by this frame while its forward is
# still open (`open`), and what it saves under `create_graph` is packed by this frame too, counted like any other
# saved tensor.
#
# Rules:
# 1. An unpack while the frame is open rebuilds from the part of forward that has run, as torch does; the site's
#    live inputs are used, not the copies handed to enclosing hooks.
# 2. The frame notes that a backward read its saved tensors while it was open (`inner`): its recompute then runs
#    that same backward over the graph recompute builds.
# 3. What such a backward unpacks is the very tensor it stands for in recompute exactly when it is in forward.
# 4. Sites without a backward inside pay nothing for any of this.
#
# Implementation notes:
# 1. (rule 1) Rerun calls the function again and stops right after the last tensor wanted; replay replays the ops
#    recorded so far.
# 2. (rule 2) So the recompute pack hook gives autograd a tensor to keep instead of nothing (rerun.py, NOTE
#    [ Recompute saves nothing ]).
# 3. (rule 3) Sites nested inside tell their inputs, and a tape its own tensors, by identity, and how many tensors
#    they hand to this frame depends on it. A tensor kept or handed over (an input, a parameter, a view of one)
#    comes back as itself in both (in forward the handed-over tensor is given back while the frame is open and
#    unmodified; in recompute the pack hook keeps it as is), a rebuilt tensor as a new object in both.


# NOTE [ Freeing long chains ]
# 1. Dropping the output of a long chain of sites (the tutorial's 1000 calls of 100 ops) frees the whole graph
#    without overflowing the C stack.
#
# Implementation notes:
# 1. (rule 1) torch frees chains of graph nodes without recursion unless a node has a Python object; reading
#    `tensor.grad_fn` from Python makes one, and freeing then recurses through Python deallocation, one level per
#    node. So the hooks never read `grad_fn` (`is_leaf` tells what they need), and kept tensors are held by the
#    frame, reached through the unpack hook, rather than by autograd.


class StopRecompute(Exception):
    """Raised from a recompute pack hook once every needed tensor is back (early stop)."""


class Handle:
    """What autograd keeps for an activation made inside a region: its index in the frame."""

    __slots__ = ("__weakref__", "index")

    def __init__(self, index: int) -> None:
        self.index = index


class Kept:
    """What autograd keeps for a tensor kept as it is: one the frame holds (an input, a parameter, a view of one), or
    one the token holds itself (`held`: the tensor, its version and what else it keeps alive), which then lives as
    long as autograd keeps the token (`Frame.keep_held`)."""

    __slots__ = ("held", "index")

    def __init__(self, index: int, held: tuple[torch.Tensor, int, object] | None = None) -> None:
        self.index = index
        self.held = held


# NOTE [ Inputs of nested sites ]
# 1. A site inside another site (or inside any saved-tensor hooks, e.g. `save_on_cpu`) hands its inputs to the
#    enclosing pack hook, as if autograd saved them there, and fetches them back through its unpack hook when it
#    recomputes (which may make the outer site recompute): the outer site can free them as it promises.
# 2. The same holds for what the nested site's own pack hook sees of its inputs and views of them
#    (`Frame.keep_outside`).
# 3. Outside any hooks a site keeps its inputs as they are (they are alive anyway while the graph is) and checks
#    their versions before recompute.


class Outer:
    """What the enclosing saved-tensor hooks packed for a frame (see NOTE [ Inputs of nested sites ])."""

    __slots__ = ("given", "packed", "requires_grad")

    def __init__(self, packed: Any, requires_grad: bool) -> None:
        self.packed = packed
        self.requires_grad = requires_grad
        # While the frame is open: the tensor itself and its version (NOTE [ Backward inside a site ]).
        self.given: tuple[torch.Tensor, int] | None = None



_INPLACE_KEPT = (
    "remat: one of the variables needed for gradient computation has been modified by an inplace "
    "operation: a tensor of shape {shape} saved in `{site}` was at version {before} when saved and is at "
    "version {after} now. Don't modify it in place between forward and backward (clone it first)."
)


# NOTE [ Parameters in recompute ]
# Rerun runs a module's forward again in backward with the module's parameters as they are then. A forward that ran
# with other tensors in their place (`torch.func.functional_call(module, params, ...)`, fast weights, a parameter
# replaced by a new one between forward and backward) would be recomputed with the module's own: values that are
# not forward's, of the same shapes, and gradients silently wrong (torch.utils.checkpoint gives them).
#
# Rules:
# 1. Where recompute saves a parameter that requires grad (or a view of one) and forward saved, at the same place,
#    a tensor it computed, or another tensor than that parameter, the recompute is a mismatch
#    (`RecomputeMismatchError`, with `check=True`, the default). Replay replays forward's own tensors and is exact.
# 2. A parameter that needs no gradient is rebuilt like any tensor (under DeepSpeed ZeRO-3 it is gathered again for
#    recompute), and is a mismatch where forward saved, at the same place, a tensor that was no parameter (a frozen
#    parameter swapped by `functional_call`). An input of the site is not a parameter of its module even where it
#    is one (recompute runs on copies of the inputs).
# 3. A buffer is a tensor like any other: one swapped by `functional_call` is recomputed from the module's own
#    (the design page's "state set by other code"; replay is exact).

class Frame:
    """The saved tensors of one forward run of a remat site, and how to rebuild them.

    Subclasses decide which tensors are kept as they are (`pack`) and how to rebuild the rest (`recompute`).
    """

    __slots__ = (
        "__weakref__", "_frozen", "_given", "_handles", "_kept", "_metas", "_stores", "check", "early_stop", "inner",
        "open", "outer", "retrace", "site", "trace",
    )

    def __init__(self, site: str, check: bool, early_stop: bool, trace: list[str] | None) -> None:
        self.site = site
        self.check = check
        self.early_stop = early_stop
        self.trace = trace  # forward's op trace under REMAT_DEBUG=1
        self.retrace: list[str] | None = None  # the running recompute's op trace
        self._handles: list[weakref.ref[Handle] | None] = []
        self._metas: list[Meta] = []
        self._frozen: set[int] = set()  # rebuilt tensors forward saved as parameters (or views of them)
        self._stores: dict[Any, dict[int, torch.Tensor]] = {}  # graph task id or GraphExecGroup -> store
        self._kept: dict[int, tuple[torch.Tensor, int]] = {}
        # See NOTE [ Backward inside a site ]: forward is running; a backward read saved tensors while it ran.
        self.open = True
        self.inner = False
        self._given: list[Outer] | None = None  # handed over while open, still holding the tensor
        # The saved-tensor hooks this frame runs inside (an enclosing site, `save_on_cpu`), or None.
        self.outer: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = top_saved_hooks(False)

    # -- forward -------------------------------------------------------------------------------------------
    def account(self, tensor: torch.Tensor) -> None:
        """Count a saved tensor that someone else keeps (the enclosing hooks), so indices stay aligned."""
        self._handles.append(None)
        if self.check:
            self._metas.append((tensor.shape, tensor.dtype, tensor.device))

    def keep(self, tensor: torch.Tensor) -> Kept:
        """Hold a saved tensor as it is, with its version, and return the token autograd keeps.

        Unpack checks that it was not modified in place since, as autograd does for the tensors it saves
        itself (with hooks installed, autograd no longer checks).
        """
        kept = Kept(len(self._handles))
        self._kept[kept.index] = (tensor, tensor._version)
        self.account(tensor)
        return kept

    def keep_held(self, tensor: torch.Tensor, owner: object = None) -> Kept:
        """Keep a saved tensor as it is in the token autograd keeps, not in the frame: it dies once autograd has
        released every token that holds it (after the ops of backward that read it ran), with `owner`, which the
        token keeps alive as long (NOTE [ What a policy keeps ] in selective.py, rule 2)."""
        kept = Kept(len(self._handles), (tensor, tensor._version, owner))
        self.account(tensor)
        return kept

    def hand_over(self, tensor: torch.Tensor) -> Outer:
        """Give a tensor from outside the frame to the enclosing pack hook (see NOTE [ Inputs of nested sites ])."""
        assert self.outer is not None
        outer = Outer(self.outer[0](tensor), tensor.requires_grad)
        if self.open:
            outer.given = (tensor, tensor._version)
            if self._given is None:
                self._given = []
            self._given.append(outer)
        return outer

    def close(self) -> None:
        """Forward has ended: hold none of the tensors handed over any more."""
        self.open = False
        if self._given is not None:
            for outer in self._given:
                outer.given = None
            self._given = None

    def keep_outside(self, tensor: torch.Tensor) -> Kept | Outer:
        """A saved tensor from outside the frame: held here, or inside other hooks handed over to them."""
        if self.outer is None:
            return self.keep(tensor)
        self.account(tensor)
        return self.hand_over(tensor)

    def handle(self, tensor: torch.Tensor) -> Handle:
        """Account a saved tensor that will be rebuilt in backward, and return its handle."""
        handle = Handle(len(self._handles))
        self._handles.append(weakref.ref(handle))
        if self.check:
            self._metas.append((tensor.shape, tensor.dtype, tensor.device))
            if isinstance(tensor, Parameter) or isinstance(tensor._base, Parameter):  # NOTE [ Parameters in
                self._frozen.add(handle.index)  # recompute ], rule 2
        return handle

    @property
    def saved(self) -> int:
        """How many tensors autograd saved inside the region."""
        return len(self._handles)

    # -- backward ------------------------------------------------------------------------------------------
    def unpack(self, packed: Any) -> torch.Tensor:
        """The unpack hook: a handle's tensor rebuilt (see NOTE [ One store per backward ]), a kept tensor as it is,
        a handed-over one back through the enclosing unpack hook."""
        kind = type(packed)
        if kind is Handle:  # the common case first
            group = graph_exec_group()
            gid: Any = graph_task_id() if group is None else group
            store = self._stores.get(gid)
            if store is None or packed.index not in store:
                store = self._rebuild(gid, store)
            tensor = store.pop(packed.index)
            if not store:  # all taken: nothing for the end-of-backward callback to drop
                self._stores.pop(gid, None)
            return tensor
        if self.open:  # see NOTE [ Backward inside a site ]
            self.inner = True
        if kind is Kept:
            return self._unpack_kept(packed)
        if kind is Outer:
            given: tuple[torch.Tensor, int] | None = packed.given
            if given is not None and given[0]._version == given[1]:  # forward still runs: the tensor itself
                return given[0]
            assert self.outer is not None
            return self.outer[1](packed.packed)
        if kind is Parcel or kind is Stay:  # kept by the site's offload: see NOTE [ Offloaded sites ]
            return packed.get()  # type: ignore[no-any-return]
        raise RematError(f"remat: `{self.site}` was handed {kind.__name__} to unpack; {BUG}.")

    def _unpack_kept(self, kept: Kept) -> torch.Tensor:
        held = kept.held
        tensor, version = (held[0], held[1]) if held is not None else self._kept[kept.index]
        if tensor._version != version:
            raise RematError(
                _INPLACE_KEPT.format(
                    shape=list(tensor.shape), site=self.site, before=version, after=tensor._version
                )
            )
        return tensor

    def _rebuild(self, gid: Any, store: dict[int, torch.Tensor] | None) -> dict[int, torch.Tensor]:
        if self.open:  # see NOTE [ Backward inside a site ]
            self.inner = True
        fresh = store is None
        if store is None:
            store = self._stores[gid] = {}
        wanted = {
            index
            for index, ref in enumerate(self._handles)
            if ref is not None and ref() is not None and index not in store
        }
        if not wanted:
            raise RecomputeMismatchError(f"remat: `{self.site}` was asked for a tensor twice; {BUG}.")
        if fresh and len(wanted) > 1 and type(gid) is int and gid != -1:
            # One tensor is taken at once by the unpack that asked (and its store dropped); more may outlive
            # this backward if some nodes never run, so a callback drops what is left when it ends.
            stores = self._stores

            def drop() -> None:
                stores.pop(gid, None)

            torch.autograd.Variable._execution_engine.queue_callback(drop)
        start = time.perf_counter()
        paused = _recording.pause()  # see NOTE [ Recompute is not recorded ] in recorder.py
        try:
            self.recompute(wanted, store)
        finally:
            _recording.resume(paused)
        _stats.add_recompute(time.perf_counter() - start)
        missing = wanted.difference(store)
        if missing:
            raise self.mismatch(
                min(missing), None, "recompute saved fewer tensors than forward did"
            )
        return store

    def recompute(self, wanted: set[int], store: dict[int, torch.Tensor]) -> None:
        """Put the rebuilt tensor of every index in `wanted` into `store`."""
        raise NotImplementedError

    def hint(self) -> str:
        """Sentences for a mismatch error naming a likely cause and its fix (see NOTE [ Mismatch hints ])."""
        return ""

    # -- checks --------------------------------------------------------------------------------------------
    def expect(self, index: int, tensor: torch.Tensor) -> None:
        """Check that recompute's `index`-th saved tensor looks like forward's (shape, dtype, device).

        Once per rebuilt tensor: the equal case is one comparison, `differs` only says how they differ.
        """
        if self.check:
            metas = self._metas
            if index >= len(metas) or metas[index] != (tensor.shape, tensor.dtype, tensor.device):
                raise self.mismatch(index, tensor, self.differs(index, tensor) or "recompute saved another tensor")
            what = self._another_parameter(index, tensor)
            if what is not None:
                raise self.mismatch(index, tensor, what)

    def differs(self, index: int, tensor: torch.Tensor) -> str | None:
        """How recompute's `index`-th saved tensor differs from forward's, or None when it does not."""
        if not self.check:
            return None
        if index >= len(self._metas):
            return "recompute saved more tensors than forward did"
        shape, dtype, device = self._metas[index]
        if tensor.shape != shape or tensor.dtype != dtype or tensor.device != device:
            return "recompute saved a different tensor than forward"
        return self._another_parameter(index, tensor)

    def _another_parameter(self, index: int, tensor: torch.Tensor) -> str | None:
        """Where recompute saved a parameter (or a view of one) that forward did not: the clause that says so (NOTE
        [ Parameters in recompute ]), else None."""
        now = tensor._base if tensor._base is not None else tensor
        if not isinstance(now, Parameter):
            return None
        kept = self._kept.get(index)
        if kept is not None:
            before = kept[0]._base if kept[0]._base is not None else kept[0]
            if before is now:
                return None
        elif index >= len(self._handles) or self._handles[index] is None:
            return None  # what enclosing hooks keep is theirs to check
        elif not now.requires_grad and index in self._frozen:
            return None  # a frozen parameter, rebuilt as itself (rule 2)
        return ("recompute saved a parameter of the module where forward saved another tensor: the module ran with "
                "other parameters in forward (`torch.func.functional_call`, or a parameter replaced between forward "
                "and backward), and rerun runs it again with the parameters it has now")

    def mismatch(
        self,
        index: int,
        tensor: torch.Tensor | None,
        what: str,
    ) -> RecomputeMismatchError:
        """Build the error for a recompute that parted from forward at saved tensor `index`.

        All of the message is made here (see `mismatch_message`), so that hints can be added in one place.
        """
        expected = self._metas[index] if index < len(self._metas) else None
        got = None if tensor is None else (tensor.shape, tensor.dtype, tensor.device)
        traces = (self.trace, self.retrace) if self.trace is not None and self.retrace is not None else None
        return RecomputeMismatchError(mismatch_message(self.site, index, what, expected, got, traces) + self.hint())
