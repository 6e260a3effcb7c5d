"""A kept output: what a policy or `remat.tag` keeps from forward, with its version when kept, so that recompute never
hands back one the function changed in place since (NOTE [ A kept output changed in place ]).

`SaveOps` and `ReuseOps` (selective.py) keep and hand back a rerun site's, the recorder and the tape (recorder.py,
tape.py) a replay site's, and rerun.py a tag's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._core.torch_compat import shared_detach, version_probe
from .transfer import Parcel

__all__ = ["CHANGED_RANDOM", "KeptOutput", "keep_output"]

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
# 5. Under torch.compile the compiler functionalises in-place ops, and what it saves is the op's own value; where
#    torch runs its checkpoint operator eagerly, its own recompute mode is made to run such an op again (NOTE [ Under
#    torch.compile ] in compiled.py). A chain keeps stage outputs, and runs a stage that changes its input on a copy
#    of it (NOTE [ A stage that changes its input ] in remat/_chain/stages.py).
# 6. An op that writes into its arguments (in place, `out=`: `bernoulli_`, chosen by a callable policy) is never
#    kept: its output is the tensor it wrote, which recompute rebuilds and the op must write into again. It runs
#    again, drawing what it drew (rule 4).
# 7. A change through an `_unsafe_view` of a kept output counts too. torch's composite ops return one in place of
#    the matmul output they made (`x @ w` of 3-D or 4-D tensors, `nn.Linear` without a bias on a 3-D input: `mm` or
#    `bmm`, then `_unsafe_view`), and an `_unsafe_view` has a version counter of its own, so `scores /= scale` on
#    what the user got left the kept `bmm` output's version as it was, and recompute divided it a second time
#    (transformers' Falcon with eager attention under `save_matmuls`: wrong gradients, no error; torch's own
#    selective checkpoint as well: CHANGELOG). What forward's mode sees of a kept output through `_unsafe_view` (and
#    `_unsafe_view`s of those) is watched with it.
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


class KeptOutput:
    """One kept output (a tensor, or the tensors of a call's outputs) and its version when it was kept (NOTE [ A
    kept output changed in place ]).

    `value` is what recompute gets back (detached, or offloaded); `watch` shares the version counter of each kept
    tensor; `repeatable` says whether running its op again gives what forward gave (False: a random op without
    `preserve_rng`).
    """

    __slots__ = ("__weakref__", "repeatable", "value", "version", "watch")

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

    def watch_also(self, alias: torch.Tensor) -> None:
        """Also count the in-place changes of `alias`, a tensor in this output's memory with a version counter of its
        own (an `_unsafe_view` of it: rule 7)."""
        probe = version_probe(alias)
        watch = self.watch
        self.watch = (*watch, probe) if type(watch) is tuple else (watch, probe)
        self.version += alias._version

    def packed(self, pack: Callable[[torch.Tensor], Any]) -> KeptOutput:
        """This kept output (one tensor, kept on the device) held through `pack` (an offload) from now on, with the
        version noted when it was kept."""
        value, watch = _keep(self.value, pack)
        return KeptOutput(value, watch, self.version, self.repeatable)


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
