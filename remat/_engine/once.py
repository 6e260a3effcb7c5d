"""Where an estimate counts a step's bytes on fake tensors, work that repeats over equal parts runs one of each size.

See NOTE [ Counted once ].
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch

from .._core.torch_compat import FakeTensor

__all__ = ["counted_once", "parts"]

_T = TypeVar("_T")

# NOTE [ Counted once ]
# Rules:
# 1. Inside `counted_once()`, work on fake tensors that repeats over parts of a tensor of at most two sizes, the
#    longer ones first (the head's chunks, tiles: `spans`) runs its first, second and last parts only: the first
#    may make what outlives the parts (the gradients' sums of tiles), the second is then a part of the first size
#    with all of that alive, and the last one of the other size. Every later part of one size holds the same bytes
#    at its peak and leaves alive what the one before it left (a part's tensors are freed before the next one
#    starts), so the step's peak and the bytes alive after it are those of all the parts, at the cost of three
#    parts where a long sequence has hundreds.
# 2. Where every part has one size (`even`), the last part is one more of the second's kind: the first two run.
# 3. Never where ops are priced (a budget's fake profile counts each part's time) or real tensors run: `parts` gives
#    every part unless the tensor is fake and a `counted_once` is open.

_open = [0]  # how many `counted_once` are open


@contextlib.contextmanager
def counted_once() -> Iterator[None]:
    """Inside, the head's chunks and tiles on fake tensors run one part of each size (an estimate's count of bytes)."""
    _open[0] += 1
    try:
        yield
    finally:
        _open[0] -= 1


def parts(items: Sequence[_T], tensor: torch.Tensor, *, even: bool = False) -> Sequence[_T]:
    """`items`, one per part of `tensor`; only the first, second and last where rule 1 applies, the first and
    second where the parts are ``even`` (all of one size: rule 2)."""
    if not _open[0] or len(items) <= 2 or not isinstance(tensor, FakeTensor):
        return items
    if even:
        return (items[0], items[1])
    return (items[0], items[1], items[-1]) if len(items) > 3 else items
