"""Dispatch modes that carry out a policy: keep the chosen ops' outputs in forward, hand them back in recompute.

See NOTE [ Policies ] in remat/_core/policies.py, NOTE [ What a policy keeps ] below, and NOTE [ A kept output
changed in place ] in kept.py.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._core.errors import RematError
from .._core.policies import Policy
from .._core.torch_compat import UNSAFE_VIEW
from .guard import storage_key
from .kept import CHANGED_RANDOM, KeptOutput, keep_output
from .modes import Mode
from .recorder import op_info
from .rng import Draw, Draws, draws, own_generator

__all__ = ["KeptCall", "ReuseOps", "SaveOps", "held_by_autograd", "reuse"]


KeptCall = KeptOutput | weakref.ref[KeptOutput] | None
"""A call's kept output in a site's list: held, held weakly (autograd saves it: NOTE [ What a policy keeps ], rule 2),
or dropped (None)."""

# NOTE [ What a policy keeps ]
# A policy names ops whose outputs are kept from forward instead of rebuilt (`save_matmuls`), so that recompute
# never runs them again. A kept output lives no longer than no remat would keep it, or than recompute needs it.
#
# Rules:
# 1. A kept output that autograd does not save itself is handed to recompute once and dropped by the site as it
#    is handed over: it dies as soon as recompute has used it, like the input of the same op in no remat's
#    forward.
# 2. A kept output that autograd saves (itself, or a view of its memory such as q/k/v split from one projection:
#    `claim`, by storage) stays as long as autograd keeps it, as in no remat: once the ops of backward that read it
#    have run (and autograd released what they saved), it is gone, though the rest of the site's backward runs on.
#    A recompute after that runs its op again.
# 3. A kept output that recompute never reaches (it stopped early, NOTE [ Early stop ] in rerun.py: the block's
#    last matmul, whose output is the block's own) is dropped when recompute ends, or it would stay through the
#    block's whole backward, which full remat never holds. A later recompute of the same graph
#    (`retain_graph=True`) runs the dropped ops again.
# 4. Every kept tensor is detached.
# 5. A kept op that draws random numbers leaves its generator where forward left it: recompute sets the state forward
#    read right after the op (NOTE [ Random ops ] in rng.py), so the random ops after it draw what they drew.
#
# Implementation notes:
# 1. (rule 1) Most kept outputs are not what autograd saves: `linear1`'s output in a transformer's MLP is read by
#    `relu`, which saves its own output; recompute needs the kept output to rebuild relu's. Per layer that costs
#    about what no remat saves (the kept input of a cheap op instead of its saved output). Kept whole, the cost
#    above no remat came from the layer whose backward runs: its kept outputs and the tensors recompute rebuilds
#    from them were alive together until the site's graph died, and peak(save_matmuls) went above peak(no remat)
#    on nn.TransformerEncoder.
# 2. (rule 4) A kept output with its grad_fn would reach the site's saved-tensor hooks, a cycle through C++ that
#    kept everything alive when the graph was dropped without backward.
# 3. (rule 2) The token autograd keeps for such a tensor holds it and its `KeptOutput` (`Frame.keep_held` in
#    hooks.py); the site's list of kept outputs holds the `KeptOutput` weakly. Held by the site itself, the kept
#    outputs of a block's MLP lived through its attention's backward too, at the step's peak, above what no remat
#    and a budget's prediction hold (docs/benchmarks.md, "A budget across families"). An offloaded site keeps its
#    outputs as before (its host copies are not device memory).


class SaveOps(Mode):
    """Forward: keep the outputs of the ops `policy` chooses, in order (see NOTE [ What a policy keeps ]), each a
    `KeptOutput` with its version (NOTE [ A kept output changed in place ] in kept.py); a call the policy's `calls`
    (or its per-call choice) leave out is kept as None. With `rng`, the state of the generator each kept random op
    drew from is read right after it (NOTE [ Random ops ] in rng.py)."""

    def __init__(
        self, policy: Policy, pack: Callable[[torch.Tensor], Any] | None = None, rng: bool = False
    ) -> None:
        super().__init__()
        self.policy = policy
        self.saves_op: Callable[[Any], bool] = policy.saves_op  # bound once: the per-op path looks up nothing else
        self.chooses = policy.chooses  # per call, after the op ran (torch's selective-checkpoint policies); or None
        self.rng = rng
        self.draws: dict[int, Draw] = {}  # per kept call of a random op: its generator's state right after it
        # how a kept output is held: detached, or `pack`ed at once (an offloaded site: the same memory autograd or the
        # next site saves, so that it is copied once; NOTE [ Offloaded sites ])
        self.pack = pack
        self.kept: list[KeptOutput | None] = []  # per chosen op call: its outputs, detached
        self.claimed: set[int] = set()  # calls whose output autograd saves (autograd keeps them: rule 2)
        self.notes: dict[int, int] = {}  # storage of a kept output -> its call
        self.calls = policy.calls  # only these calls (NOTE [ Some calls ] in remat/_core/policies.py); None: all

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        before = None
        if kwargs:
            if self.rng and "generator" in kwargs and self.saves_op(func):
                # an op's own generator: its state before the op too (NOTE [ A kept output changed in place ])
                generator = own_generator(kwargs)
                before = None if generator is None else generator.get_state()
            out = func._op(*args, **kwargs)
        else:
            out = func._op(*args)  # `_op`: no Python frame of `__call__`
        if func is UNSAFE_VIEW and self.notes:  # a kept output's alias: NOTE [ A kept output changed in place ]
            index = self.notes.get(storage_key(args[0]))  # type: ignore[arg-type]
            kept = self.kept[index] if index is not None else None
            if kept is not None:
                kept.watch_also(out)
        if self.saves_op(func):
            index = len(self.kept)
            if (self.calls is not None and index not in self.calls) or (
                self.chooses is not None and not self.chooses(func, args, kwargs, out)
            ):
                self.kept.append(None)  # recompute runs this call again
                return out
            repeatable = True
            if draws(func, args, kwargs):
                if self.rng:
                    self.draws[index] = Draw.after(args, kwargs, before)
                else:  # running it again would draw afresh: NOTE [ A kept output changed in place ], rule 4
                    repeatable = False
            if op_info(func).writes:  # it writes into its arguments: never kept (rule 6 of the NOTE in kept.py)
                self.kept.append(None)
                return out
            self.kept.append(keep_output(out, self.pack, repeatable))
            if isinstance(out, torch.Tensor):
                self._note(out, index)
            else:
                for t in out:
                    if isinstance(t, torch.Tensor):
                        self._note(t, index)
        return out

    def _note(self, tensor: torch.Tensor, index: int) -> None:
        key = storage_key(tensor)
        if key is not None:
            self.notes[key] = index

    def claim(self, tensor: torch.Tensor) -> KeptOutput | None:
        """The kept output in whose memory `tensor`, which autograd saves, lies, if it was not changed in place (then
        autograd keeps it: NOTE [ What a policy keeps ], rule 2; NOTE [ A kept output changed in place ], rule 3);
        else None."""
        if not self.notes:
            return None
        index = self.notes.get(storage_key(tensor))  # type: ignore[arg-type]
        if index is None:
            return None
        kept = self.kept[index]
        if kept is None or kept.moved():
            return None
        self.claimed.add(index)
        return kept

    def finish(self) -> tuple[list[KeptOutput | None], set[int], dict[int, Draw]]:
        """End of forward: the kept outputs in order, which of them autograd saves, and the draws of those that are
        random. Outputs changed in place since they were kept are dropped, unless running their op again would not
        give what forward gave (NOTE [ A kept output changed in place ], rules 3 and 4: recompute raises there)."""
        kept, claimed, drawn = self.kept, self.claimed, self.draws
        self.kept, self.claimed, self.notes, self.draws = [], set(), {}, {}
        for index, entry in enumerate(kept):
            if entry is not None and entry.repeatable and entry.moved():
                kept[index] = None
                claimed.discard(index)
        return kept, claimed, drawn


def held_by_autograd(kept: list[KeptOutput | None], claimed: set[int]) -> list[KeptCall]:
    """`kept` (forward's, from `SaveOps.finish`) with the outputs autograd saves held weakly: autograd's tokens hold
    them (NOTE [ What a policy keeps ], implementation note 3)."""
    return [weakref.ref(entry) if entry is not None and index in claimed else entry
            for index, entry in enumerate(kept)]


def reuse(kept: Any) -> Any:
    """A kept output handed back for one recompute: fresh detached tensors (autograd wraps op outputs)."""
    if isinstance(kept, torch.Tensor):
        return kept.detach()
    return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in kept)


class ReuseOps(Mode):
    """Recompute: hand back forward's kept outputs of the chosen ops instead of running them again.

    An output autograd does not save is dropped from `kept` as it is handed back (NOTE [ What a policy keeps ]);
    an op whose output was dropped runs again, and so does one whose output was changed in place since it was kept
    (NOTE [ A kept output changed in place ] in kept.py). A kept random op's generator is set to the state forward
    left it in (`draws`; NOTE [ Random ops ] in rng.py), and put back as it was when recompute ends.
    """

    def __init__(
        self, policy: Policy, kept: list[KeptCall], claimed: set[int],
        unpack: Callable[[Any], Any] | None = None, draws: dict[int, Draw] | None = None, site: str = "?",
    ) -> None:
        super().__init__()
        self.policy = policy
        self.saves_op = policy.saves_op  # bound once: the per-op path looks up nothing else
        self.kept = kept
        self.claimed = claimed
        self.unpack = unpack  # brings an offloaded kept output back (NOTE [ Offloaded sites ])
        self.draws = draws or None
        self.forked = Draws() if self.draws else None
        self.site = site
        self.next = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.saves_op(func):
            index = self.next
            self.next = index + 1
            entry = self.kept[index] if index < len(self.kept) else None
            # held weakly where autograd saves it: gone once backward no longer needs it (rule 2)
            kept = entry() if isinstance(entry, weakref.ref) else entry
            if kept is not None:
                if index not in self.claimed:
                    self.kept[index] = None
                now = kept.now()
                if now == kept.version:
                    if self.draws is not None and (draw := self.draws.get(index)) is not None:
                        draw.set(self.forked)
                    value = kept.value
                    return reuse(value if self.unpack is None else self.unpack(value))
                # changed in place since it was kept: run the op again (NOTE [ A kept output changed in place ])
                self.kept[index] = None
                if not kept.repeatable:
                    raise RematError(CHANGED_RANDOM.format(site=self.site, op=func, before=kept.version, after=now))
            if self.draws is not None and (draw := self.draws.get(index)) is not None:
                draw.rewind(self.forked)  # it runs again: its own generator where it stood before it in forward
        return func._op(*args, **kwargs) if kwargs else func._op(*args)

    def __exit__(self, *exc: Any) -> None:
        # What recompute did not reach is dropped too (NOTE [ What a policy keeps ]), unless autograd saves it.
        kept, claimed = self.kept, self.claimed
        for index in range(self.next, len(kept)):
            if index not in claimed:
                kept[index] = None
        if self.forked is not None:
            self.forked.restore()
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
