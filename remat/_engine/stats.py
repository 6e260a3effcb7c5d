"""Process-wide counters that `remat.measure` and the tests read: time spent rebuilding activations in backward,
and the chunks of logits `remat.linear_cross_entropy` made."""

from __future__ import annotations

__all__ = ["add_head_chunk", "add_recompute", "add_tile", "recompute_seconds"]

recompute_seconds = 0.0
recomputes = 0
head_chunks = 0
"""Chunks of logits `linear_cross_entropy` made in eager code (forward, and backward for `reduction="none"`)."""


def add_recompute(seconds: float) -> None:
    """Account one recompute (rerun or replay) that took `seconds`."""
    global recompute_seconds, recomputes
    recompute_seconds += seconds
    recomputes += 1


def add_head_chunk() -> None:
    """Account one chunk of logits made by `linear_cross_entropy`."""
    global head_chunks
    head_chunks += 1


tiles = 0
"""Tiles a tiled function rebuilt in backward (remat/_engine/tiles.py)."""


def add_tile() -> None:
    """Account one tile rebuilt and differentiated in backward."""
    global tiles
    tiles += 1
