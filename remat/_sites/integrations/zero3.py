"""DeepSpeed ZeRO-3 parameters across the tiles of a tiled module (NOTE [ Tiles ], rule 5).

Imported only for a tiled module whose parameters carry ZeRO-3's marks (`ds_active_sub_modules`); it reads those
marks and never imports deepspeed itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Gathered"]

# NOTE [ ZeRO-3 across tiles ]
# ZeRO-3 hooks every module: a module's forward pre-hook gathers its parameters and its forward hook releases
# them, unless another module still uses them (`param.ds_active_sub_modules`, the ids of the modules that do); in
# backward, hooks on the module's outputs and inputs do the same. A tiled module calls the modules inside it once
# per tile, so their parameters would be gathered and released once per tile, in forward and again in backward.
#
# Rules:
# 1. While the tiles run, each parameter of the tiled module counts one more user (an id of our own, negative, so
#    no module's), so the modules' hooks release nothing: the first tile's pre-hooks gather, the others find the
#    parameters there.
# 2. The extra user goes before the last call whose hooks release (NOTE [ Tiles ], implementation note 3), so
#    ZeRO-3 releases the parameters where its own hooks would, and its own count of gathered parameters stays
#    right; and in any case when the tiles end (an exception included).


class Gathered:
    """Counts one more user for each of `params` between `keep()` and `let_go()` (see the NOTE above)."""

    __slots__ = ("kept", "params", "token")

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = params
        self.token = -1 - id(self)
        self.kept = False

    def keep(self) -> None:
        if not self.kept:
            for param in self.params:
                param.ds_active_sub_modules.add(self.token)  # type: ignore[attr-defined]
            self.kept = True

    def let_go(self) -> None:
        if self.kept:
            for param in self.params:
                param.ds_active_sub_modules.discard(self.token)  # type: ignore[attr-defined]
            self.kept = False

    def close(self) -> None:
        self.let_go()
