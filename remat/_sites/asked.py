"""What `remat.apply(model, tiles=N, head=True)` asks of the model besides its blocks' policies: the blocks'
token-wise modules in tiles (NOTE [ What is tiled ] in tiles.py) and the head routed (head.py), put on before the
driver of the request's mode plans or wraps the blocks, and taken back where that driver raises. Each driver enters
them itself (remat/_apply/drive.py for the blocks, remat/_apply/memory.py, remat/_budget/driver.py), so that a
budget's profile runs the blocks tiled and the head routed.

A budget or memory plan may also take the head and the tiles where only they fit; those are its choices, not asked
here (remat/_budget/head_choice.py, remat/_budget/tiles_choice.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from torch import nn

from .._core.requests import Request
from . import targets as _targets
from .head import route_head, routed_by, unroute_head
from .tiles import nothing_tiled, tile_blocks, tiled_of, untile

__all__ = ["carried", "head_asked", "tiles_asked"]

_log = logging.getLogger("remat")


@contextlib.contextmanager
def tiles_asked(model: nn.Module, request: Request) -> Iterator[None]:
    """`tiles=N`: the token-wise modules of the blocks `where` selects, tiled in place (every selected block, also
    those `every` leaves out: tiles lower what a block holds, rematerialized or not), and untiled again where the
    body raises. A ValueError that says what was looked for where the blocks hold none."""
    count = request.tile_count
    if count is None:
        yield
        return
    blocks = _targets.select(model, request.where)
    report = tile_blocks(blocks, count)
    if not report.tiled:
        raise nothing_tiled(report, blocks)
    if report.skipped:  # NOTE [ What is tiled ], rule 2: a mixture of experts
        name, why = report.skipped[0]
        more = f" and {len(report.skipped) - 1} more like it" if len(report.skipped) > 1 else ""
        _log.warning("remat: tiles=%d on `%s` left `%s`%s untiled (%s); %d modules run in tiles.", count,
                     type(model).__name__, name, more, why, len(report.tiled))
    try:
        yield
    except BaseException:
        for name in report.tiled:
            untile(model.get_submodule(name))
        raise


@contextlib.contextmanager
def head_asked(model: nn.Module, request: Request) -> Iterator[None]:
    """`head=True`: the model's head routed (a ValueError naming what was looked for where it has none), and put
    back where the body raises."""
    if not request.head:
        yield
        return
    route_head(model)
    try:
        yield
    except BaseException:
        unroute_head(model)
        raise


def carried(model: nn.Module) -> tuple[bool, int | None]:
    """What `model` carries besides its blocks' sites, asked by this request or left by an earlier `remat.apply`:
    whether its head is routed, and the fewest tiles any of its modules runs in (None: none is tiled). Where it
    carries either, its step without remat is not the step a profile runs with every block kept."""
    counts = [tiled.tiles for module in model.modules() if (tiled := tiled_of(module)) is not None]
    return routed_by(model) is not None, min(counts, default=None)
