"""Op traces for `REMAT_DEBUG=1`: what forward ran next to what recompute ran, to find where they part."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from .modes import Mode

__all__ = ["OpTrace", "describe", "side_by_side"]


def describe(func: Any, out: Any) -> str:
    """One line of an op trace: the op and the shapes of the tensors it returned."""
    shapes = [
        tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else (out,))
        if isinstance(t, torch.Tensor)
    ]
    return f"{func}{shapes if shapes else ''}"


class OpTrace(Mode):
    """Record each aten op that runs inside, with its output shapes, into `lines`."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        self.lines.append(describe(func, out))
        return out


def side_by_side(forward: list[str], recompute: list[str], width: int = 60) -> str:
    """Two op traces as columns, the first differing row marked with `>>`."""
    rows = [f"   {'forward':<{width}} recompute"]
    marked = False
    for left, right in itertools.zip_longest(forward, recompute, fillvalue=""):
        mark = "   "
        if left != right and not marked:
            mark, marked = ">> ", True
        rows.append(f"{mark}{left[:width]:<{width}} {right[:width]}")
    return "\n".join(rows)
