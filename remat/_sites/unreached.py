"""The blocks `remat.apply(model)` rematerializes that the model's forward never calls as modules.

See NOTE [ Blocks that forward never calls ].
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._engine.compiled import compiling
from .blocks import describe_unreached
from .targets import opener_of

__all__ = ["NeverRan", "watch_blocks"]

# NOTE [ Blocks that forward never calls ]
# A block is a site through its forward hooks, so it is rematerialized only where it is called as a module
# (`block(x)`). A model may call its blocks otherwise: EnCodec's and Mimi's models call their quantizer's layers
# through `layer.encode(...)`, and a user's model may call `block.forward(x)` or a method of its own. Such an
# apply rematerializes nothing, and nothing but memory says so.
# Rules:
# 1. After `remat.apply(model)` places blocks (picked or named by `where`), the model's first forward in which
#    those sites would act (grad enabled, the switch on, not compiling) checks whether any of them was called as a
#    module (under `no_grad` too: a frozen block the forward calls is called). Blocks whose sites never act are
#    not watched (`enabled=False`, `save_all`), nor blocks of a class decorated with `@remat`, whose forward is a
#    site however it is called. Where none was, one `UserWarning` names the model, the blocks and what to do;
#    where any was (a layer drop skips some), nothing is said. Either way the check then leaves the model.
# 2. A forward in which the sites would not act (no grad, `REMAT=0`, inside a compiled frame) leaves the check
#    waiting for the next one.
# 3. The check is remat's own hook: `remat.undo` takes it off, a model set aside hides it, it pickles and
#    deep-copies with the model, and applying again replaces it.
#
# Implementation notes:
# 1. (rule 1) Each site's opener notes that it ran (`_Open.ran`, one attribute store per region, and one the
#    first time it is called without acting); the check decides on the first forward, which says so; it finds
#    the openers by the blocks' qualified names, so copies of the model check their own blocks.
# 2. A budget or a memory request profiles its blocks on the step itself and refuses blocks that never ran there
#    (`profile` in remat/_budget/profile.py).


class NeverRan:
    """The forward hook on a model that warns once where its first training forward ran none of its blocks'
    sites (NOTE [ Blocks that forward never calls ])."""

    _remat_owned = True  # `remat.undo` removes it (see `targets._is_ours`)

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)

    def __call__(self, model: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or compiling():
            return  # rule 2
        openers = []
        for name in self.names:
            try:
                opener = opener_of(model.get_submodule(name))
            except AttributeError:  # the model changed since: nothing to check there
                continue
            if opener is not None and opener.active():
                openers.append(opener)
        if not openers:
            return  # rule 2: `REMAT=0`, or every block switched off
        _forget(model)
        if not any(opener.ran for opener in openers):
            message = describe_unreached(model, self.names, "rematerialized", "nothing is rematerialized")
            warnings.warn(message, UserWarning, stacklevel=5)


def watch_blocks(model: nn.Module, names: Sequence[str]) -> None:
    """Check on `model`'s first training forward that it ran a site among its blocks `names` (rule 1)."""
    _forget(model)
    openers = {name: opener_of(model.get_submodule(name)) for name in names}
    watched = [name for name, opener in openers.items()  # rule 1: sites that can act (not `enabled=False`)
               if opener is not None and not opener.engine.passthrough and opener.options.enabled is not False]
    if watched:
        model.register_forward_hook(NeverRan(watched))


def _forget(model: nn.Module) -> None:
    for key in [key for key, hook in model._forward_hooks.items() if isinstance(hook, NeverRan)]:
        del model._forward_hooks[key]
