"""Process-wide counters that `remat.measure` reads: time spent rebuilding activations in backward."""

from __future__ import annotations

__all__ = ["add_recompute", "recompute_seconds"]

recompute_seconds = 0.0
recomputes = 0


def add_recompute(seconds: float) -> None:
    """Account one recompute (rerun or replay) that took `seconds`."""
    global recompute_seconds, recomputes
    recompute_seconds += seconds
    recomputes += 1
