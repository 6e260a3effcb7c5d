"""Tiles as a choice of a budget's plan (`remat.apply(model, budget=... | memory=...)`): whether the driver may tile
the blocks' token-wise modules, tiling them, and taking the tiles back (NOTE [ Tiles as a choice ]). The driver
(driver.py) takes the step; this module answers it, as head_choice.py answers the head's.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .._core.requests import TILES
from .._sites.tiles import tile_blocks, tile_module, tiled_of, untile
from .head_choice import BY_BUDGET

__all__ = ["TilesChoice"]

# NOTE [ Tiles as a choice ]
# Full remat leaves one block's internals alive while its backward runs; a transformer MLP's are several times its
# input. Run in tiles (`remat.tiled`, NOTE [ What is tiled ] in remat/_sites/tiles.py), they shrink by the tile
# count, exactly, at the cost of one more run of the token-wise modules' forward in backward per tile's graph. A
# budget may need that at long sequences, where full remat with the head in chunks no longer fits.
#
# Rules:
# 1. With `tiles=None` (apply's default) a budget or memory plan tiles only where no choice per block is predicted
#    to fit with the model's own head, and then none with the head routed where the head may be routed (NOTE [ The
#    head as a choice ]): the head first, since it costs no time and tiles do. It then tiles the token-wise modules
#    of every block (`tile_blocks`) in `TILES` tiles and plans again, profile, costs and solve, for the same bytes,
#    before any real step: what tiles save is priced as every choice is, by the profile of the tiled blocks (their
#    costs under every choice are those of the blocks with tiles). Where a plan predicted to fit without tiles is
#    refused by its real steps, the head and then the tiles are taken the same way.
# 2. One count, for every block: `TILES`. Past a few tiles what is left of a block's backward is its input and the
#    attention's internals, which tiles do not touch, so a larger count buys little memory for more calls; a count
#    per block would multiply the profile by the counts tried. `tiles=N` tiles before planning, whatever the
#    budget, and a fractional budget is of the step without tiles, as for a head (NOTE [ The head as a choice ],
#    rule 2; so are tiles an earlier `remat.apply` left on the model); `tiles=False` never tiles.
# 3. Tiles the budget chose show in `remat.plan(model)` as chosen by it, and every re-plan (a new input shape)
#    chooses again: first without them. A module the user tiled (`remat.tiled(module, tiles=4)`) keeps its own
#    tiles: the choice tiles the other token-wise modules, and never takes the user's back. A plan that fails takes
#    back its own, and a re-plan that fails puts back those the plan before it had chosen.
# 4. Only where they are needed: tiles cost time (each tiled module's forward runs once more per backward, outside
#    a rematerialized block's recompute), and a plan that fits without them is faster.
# 5. Only in eager code: inside one compiled graph (`compile=True`) a tiled call runs untiled (NOTE [ What is tiled
#    ], rule 5), so there the choice is closed, and `memory=`'s least estimate leaves tiles out.
#
# Implementation notes:
# 1. (rule 1) Blocks without a token-wise module leave nothing to tile: the choice is closed, and the plan goes on
#    without it (verified, or refused, on its own).


class TilesChoice:
    """The tiles' choice for one plan of `model`'s blocks `names` (NOTE [ Tiles as a choice ]).

    `open` says whether the plan may still tile: apply's `tiles` is None, and its steps are not one compiled graph
    (rule 5). Made at the start of a plan, it takes back the tiles an earlier plan chose (rule 3).
    """

    profiled = True  # rule 1: the profile runs the tiled blocks

    def __init__(self, model: nn.Module, names: Sequence[str], tiles: int | bool | None,
                 compiled: bool = False) -> None:
        self.model = model
        self.names = tuple(names)
        self.tiled: tuple[str, ...] = ()  # what this plan tiled
        self.open = tiles is None and not compiled
        self.earlier: list[tuple[str, int, int]] = []  # what an earlier plan tiled: name, count, dim (rule 3)
        for name, module in model.named_modules():  # rule 3: a re-plan chooses again
            found = tiled_of(module) if "forward" in module.__dict__ else None
            if found is not None and found.chosen_by == BY_BUDGET:
                self.earlier.append((name, found.tiles, found.dim))
                untile(module)

    def take(self) -> bool:
        """Tile every block's token-wise modules for the plan (rule 1); whether there were any (implementation note
        1). Closes the choice: a plan tiles once."""
        self.open = False
        blocks = [(name, self.model.get_submodule(name)) for name in self.names]
        self.tiled = tile_blocks(blocks, TILES, chosen_by=BY_BUDGET).tiled
        return bool(self.tiled)

    def take_back(self) -> None:
        """Untile what this plan tiled."""
        for name in self.tiled:
            untile(self.model.get_submodule(name))
        self.tiled = ()

    def end(self, made: bool) -> None:
        """The plan is made (`made`), or it failed: its own tiles taken back and an earlier plan's put back (rule
        3)."""
        if made:
            return
        self.take_back()
        for name, count, dim in self.earlier:
            tile_module(self.model.get_submodule(name), count, dim, chosen_by=BY_BUDGET)
