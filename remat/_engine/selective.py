"""Dispatch modes that carry out a policy: keep the chosen ops' outputs in forward, hand them back in recompute.

See NOTE [ Policies ] in remat/_core/policies.py, NOTE [ What a policy keeps ] and NOTE [ A kept output changed in
place ] below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._core.errors import RematError
from .._core.policies import Policy
from .._core.torch_compat import shared_detach
from .guard import storage_key
from .modes import Mode
from .recorder import op_info
from .rng import Draw, Draws, draws, own_generator
from .transfer import Parcel

__all__ = ["CHANGED_RANDOM", "KeptOutput", "ReuseOps", "SaveOps", "keep_output", "reuse", "version_probe"]

# NOTE [ What a policy keeps ]
# A policy names ops whose outputs are kept from forward instead of rebuilt (`save_matmuls`), so that recompute
# never runs them again. A kept output lives no longer than no remat would keep it, or than recompute needs it.
#
# Rules:
# 1. A kept output that autograd does not save itself is handed to recompute once and dropped by the site as it
#    is handed over: it dies as soon as recompute has used it, like the input of the same op in no remat's
#    forward.
# 2. A kept output that autograd saves (itself, or a view of its memory such as q/k/v split from one projection:
#    `claim`, by storage) stays while the site's graph does, as no remat keeps it.
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

# NOTE [ A kept output changed in place ]
# A policy keeps the op's output tensor itself. When the function then changes it in place (`h = x @ w; h += b`,
# `h.mul_(s)`, `scores.masked_fill_(...)`, a write through a view of it, or a change after the site returned), the
# kept tensor no longer holds what the op made; handed back in recompute, the change would be applied to it a second
# time and everything after it rebuilt from wrong values, silently.
#
# Rules:
# 1. Every kept output, whatever keeps it (a policy's op in either strategy, a `remat.tag` for a saved name, a budget
#    plan's calls, torch's selective contexts through `remat.checkpoint`, an offloaded policy), is noted with its
#    version when it is kept. `tensor._version` counts every in-place change of its memory made through autograd,
#    through any view.
# 2. Recompute hands a kept output back only while its version is the one noted. Where it moved, recompute runs the
#    op again from its rebuilt inputs (a tagged tensor: takes what recompute rebuilt): exact gradients, and only
#    that op loses its saving.
# 3. What moved by the end of forward is dropped then, and a tensor that autograd saves in its memory is rebuilt
#    like any other rather than kept by reference (`claim`): the site holds for it what full remat holds. A budget
#    prices it so (NOTE [ Deriving choices ] in remat/_budget/costs_derived.py).
# 4. A kept op that drew random numbers runs again drawing what it drew in forward: with `preserve_rng`, recompute's
#    generator stands where forward's stood before that op (every random op before it ran again or set its draw:
#    NOTE [ Random ops ] in rng.py). Without `preserve_rng` it would draw another mask, so running it again is
#    impossible: recompute raises an error that names the site, the op and the change, never a silent difference.
# 5. Under torch.compile the compiler functionalises in-place ops, and what it saves is the op's own value: nothing
#    to note (NOTE [ Under torch.compile ] in compiled.py).
# 6. An op that writes into its arguments (in place, `out=`: `bernoulli_`, chosen by a callable policy) is never
#    kept: its output is the tensor it wrote, which recompute rebuilds and the op must write into again. It runs
#    again, drawing what it drew (rule 4).
#
# Implementation notes:
# 1. (rule 1) A dispatch mode's handler runs below autograd's view tracking, where a plain `detach` makes a tensor
#    with a version counter of its own, blind to every later change (so the tape's old check never fired). The kept
#    tensor is detached with that tracking on (`shared_detach`, as torch's selective checkpoint does): it shares the
#    output's counter. An offloaded kept output (a `Parcel`) holds no device memory; its version is read from a
#    probe, a detached tensor whose data is swapped for an empty one, which keeps the counter and none of the memory
#    (`version_probe`).
# 2. (rule 2) One version read per kept output per recompute; ops that are not kept pay nothing, and the per-op
#    paths (the tape's recorder, a site without a policy) are untouched.
# 3. (rule 3) Not claiming matters: claimed, the saved tensor would hold the changed value for good, the op would
#    still run again in recompute, and the site would hold more than either full remat or the policy without it.
# 4. (rules 4, 6) An op given its own `generator=`, which no stash covers, has that generator's state read before
#    it too (`Draw.before`): running again, it is set there first and put back when recompute ends.
# 5. torch's own selective checkpoint checks the same counter and raises "Tensor cached during selective activation
#    checkpoint has been mutated" (with `allow_cache_entry_mutation=True` it hands the changed tensor back: wrong
#    gradients). remat's drop-in carries out torch's contexts itself (NOTE [ Selective contexts ] in
#    remat/_sites/checkpoint.py), so the rule above applies there too, with or without that flag.

CHANGED_RANDOM = (
    "remat: `{site}` keeps the output of {op}, which draws random numbers, and the function changed that output in "
    "place after the op (its version went from {before} to {after}: `h.mul_(...)`, `h += ...`, `h.masked_fill_(...)` "
    "or a write through a view of it). Recompute must run {op} again, and without `preserve_rng` it would draw other "
    "random numbers than forward did: wrong gradients. Keep `preserve_rng=True` (`preserve_rng_state=True` for "
    "remat.checkpoint), or make the change out of place (`h = h * s`)."
)


def version_probe(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that shares `tensor`'s version counter and holds none of its memory (NOTE [ A kept output changed in
    place ], implementation note 1).

    >>> h = torch.ones(1024)
    >>> probe = version_probe(h)
    >>> h.mul_(2)[0].add_(1)  # changed in place, also through a view
    tensor(3.)
    >>> probe._version == h._version, probe.untyped_storage().nbytes()
    (True, 0)
    """
    probe = shared_detach(tensor)
    probe.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)  # the same kind of tensor
    return probe


class KeptOutput:
    """One kept output (a tensor, or the tensors of a call's outputs) and its version when it was kept (NOTE [ A
    kept output changed in place ]).

    `value` is what recompute gets back (detached, or offloaded); `watch` shares the version counter of each kept
    tensor; `repeatable` says whether running its op again gives what forward gave (False: a random op without
    `preserve_rng`).
    """

    __slots__ = ("repeatable", "value", "version", "watch")

    def __init__(self, value: Any, watch: Any, version: int, repeatable: bool = True) -> None:
        self.value = value
        self.watch = watch
        self.version = version
        self.repeatable = repeatable

    def now(self) -> int:
        """The version of the kept tensor(s) now (a sum over a call's outputs: versions only grow)."""
        watch = self.watch
        if type(watch) is tuple:
            return sum(t._version for t in watch)
        return watch._version  # type: ignore[no-any-return]

    def moved(self) -> bool:
        """Whether the kept tensor(s) were changed in place since they were kept."""
        return self.now() != self.version


def keep_output(out: Any, pack: Callable[[torch.Tensor], Any] | None = None, repeatable: bool = True) -> KeptOutput:
    """Keep an op's output (a tensor, or a tuple or list with tensors), each tensor detached sharing its version
    counter (`shared_detach`) or handed to `pack` (an offload), with its version now."""
    if isinstance(out, torch.Tensor):
        value, watch = _keep(out, pack)
        return KeptOutput(value, watch, out._version, repeatable)
    values: list[Any] = []
    watches: list[torch.Tensor] = []
    version = 0
    for t in out:
        if isinstance(t, torch.Tensor):
            value, watch = _keep(t, pack)
            values.append(value)
            watches.append(watch)
            version += t._version
        else:
            values.append(t)
    return KeptOutput(tuple(values), tuple(watches), version, repeatable)


def _keep(tensor: torch.Tensor, pack: Callable[[torch.Tensor], Any] | None) -> tuple[Any, torch.Tensor]:
    alias = shared_detach(tensor)
    if pack is None:
        return alias, alias
    value = pack(alias)
    return value, version_probe(alias) if type(value) is Parcel else alias


class SaveOps(Mode):
    """Forward: keep the outputs of the ops `policy` chooses, in order (see NOTE [ What a policy keeps ]), each a
    `KeptOutput` with its version (NOTE [ A kept output changed in place ]); a call the policy's `calls` (or its
    per-call choice) leave out is kept as None. With `rng`, the state of the generator each kept random op drew from
    is read right after it (NOTE [ Random ops ] in rng.py)."""

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
        self.claimed: set[int] = set()  # calls whose output autograd saves (kept for the graph's lifetime)
        self.notes: dict[int, int] = {}  # storage of a kept output -> its call
        self.calls = policy.calls  # only these calls (NOTE [ Some calls ] in remat/_core/policies.py); None: all

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        before = None
        if kwargs:  # an op's own generator: its state before the op too (NOTE [ A kept output changed in place ])
            generator = own_generator(kwargs)
            if generator is not None and self.rng and self.saves_op(func):
                before = generator.get_state()
            out = func._op(*args, **kwargs)
        else:
            out = func._op(*args)  # `_op`: no Python frame of `__call__`
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
            if op_info(func).writes:  # it writes into its arguments: never kept (rule 6 of the NOTE)
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

    def claim(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`, which autograd saves, lies in the memory of a kept output that was not changed in place
        (then keep it for good; NOTE [ A kept output changed in place ], rule 3)."""
        if not self.notes:
            return False
        index = self.notes.get(storage_key(tensor))  # type: ignore[arg-type]
        if index is None:
            return False
        kept = self.kept[index]
        if kept is None or kept.moved():
            return False
        self.claimed.add(index)
        return True

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


def reuse(kept: Any) -> Any:
    """A kept output handed back for one recompute: fresh detached tensors (autograd wraps op outputs)."""
    if isinstance(kept, torch.Tensor):
        return kept.detach()
    return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in kept)


class ReuseOps(Mode):
    """Recompute: hand back forward's kept outputs of the chosen ops instead of running them again.

    An output autograd does not save is dropped from `kept` as it is handed back (NOTE [ What a policy keeps ]);
    an op whose output was dropped runs again, and so does one whose output was changed in place since it was kept
    (NOTE [ A kept output changed in place ]). A kept random op's generator is set to the state forward left it in
    (`draws`; NOTE [ Random ops ] in rng.py), and put back as it was when recompute ends.
    """

    def __init__(
        self, policy: Policy, kept: list[KeptOutput | None], claimed: set[int],
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
            kept = self.kept[index] if index < len(self.kept) else None
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
