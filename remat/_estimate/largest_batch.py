"""The largest batch size (and sequence length) whose training step fits in a memory, per configuration.

NOTE [ Searching the largest batch ]
`remat.estimate(..., memory=, batch_dim=)` asks, for each configuration, for the largest batch size whose whole
step (forward, backward, optimizer step, the state included) peaks at most at ``memory``.

Rules:
1. Each candidate size is an estimate of the same configuration on a sample resized along ``batch_dim`` (every
   tensor of the sample whose size there is the sample's batch size), run in the same fake session, so the
   optimizer's state is made once.
2. The answer is checked: the size fits and the next one up does not. A size whose planner refuses its budget
   (a refused row) does not fit. Sizes are capped at `CAP`.
3. With ``seq_dim`` the same search runs along the sequence at the sample's batch size.

Implementation notes:
1. (rule 2) The search is a bisection: from a first guess it doubles its step until one size fits and the next
   does not bracket the answer, then halves the bracket; a bad guess costs a few more estimates.
2. (rule 2) The first guess extrapolates each phase's peak on the line through the sample's size and twice it,
   and takes the size where the first of them reaches ``memory``: a step's peak is the largest of several lines
   (early in backward the activations dominate, late in backward the gradients, the optimizer step holds no
   activations), and at small sizes the steep one is often not yet the highest, so extrapolating the whole step's
   peak (flat there) guesses far too high. Forward's peak is one such line, and backward's early peak lies just
   above it, so the guess is near.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .._core.errors import BudgetError
from .._core.torch_compat import tree_leaves
from .._core.units import parse_memory
from .._measure.fake import map_sample
from .predict import Configured, Refine
from .report import ConfigEstimate

__all__ = ["CAP", "largest", "largest_sizes", "resized", "searches", "size_along"]

CAP = 1 << 20
"""The largest size searched for."""


def resized(sample: Any, dim: int, old: int, new: int) -> Any:
    """``sample`` with every tensor of size ``old`` along ``dim`` made of size ``new`` there (as meta tensors)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.dim() <= dim or t.shape[dim] != old:
            return t
        shape = list(t.shape)
        shape[dim] = new
        out = torch.empty(shape, dtype=t.dtype, device="meta")
        return out.requires_grad_(t.requires_grad and t.is_floating_point())

    return map_sample(sample, one)


def size_along(sample: Any, dim: int, what: str) -> int:
    """The size of the sample's first tensor along ``dim`` (a ValueError naming ``what`` when it has no such dim)."""
    for t in tree_leaves(dict(sample) if isinstance(sample, dict) else sample):
        if isinstance(t, torch.Tensor) and t.dim() > dim:
            return int(t.shape[dim])
    raise ValueError(f"remat: estimate's `{what}={dim}` must be a dimension of the sample's tensors, but none of "
                     f"them has a dimension {dim}; give the dimension of the sample's tensors to grow.")


def largest(fits: Callable[[int], bool], guess: int, cap: int = CAP) -> int:
    """The largest ``n`` in [1, cap] with ``fits(n)`` (fitting is monotone), 0 if none; bisection from ``guess``.

    >>> calls = []
    >>> largest(lambda n: calls.append(n) or n <= 37, guess=30), calls
    (37, [30, 31, 33, 37, 45, 41, 39, 38])
    """
    guess = min(max(guess, 1), cap)
    seen: dict[int, bool] = {}

    def ok(n: int) -> bool:
        if n not in seen:
            seen[n] = fits(n)
        return seen[n]

    if ok(guess):
        lo, step = guess, 1
        while lo < cap and ok(min(lo + step, cap)):
            lo, step = min(lo + step, cap), step * 2
        if lo == cap:
            return cap
        hi = min(lo + step, cap)
    else:
        hi, step = guess, 1
        while hi > 1 and not ok(max(hi - step, 1)):
            hi, step = max(hi - step, 1), step * 2
        if hi == 1:
            return 0
        lo = max(hi - step, 1)
    while hi - lo > 1:  # ok(lo), not ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _search(row: ConfigEstimate, sample: Any, dim: int, memory: int,
            run: Callable[[Any], ConfigEstimate]) -> int:
    size = size_along(sample, dim, "dim")  # checked by `estimate` before any step runs

    def at(n: int) -> ConfigEstimate | None:
        try:
            got = row if n == size else run(resized(sample, dim, size, n))
        except BudgetError:
            return None
        return None if got.refused is not None else got

    def fits(n: int) -> bool:
        got = at(n)
        return got is not None and got.peak_bytes <= memory

    twice = at(2 * size) if fits(size) else None
    return largest(fits, _guess(row, twice, size, memory) if twice is not None else size)


def _guess(row: ConfigEstimate, twice: ConfigEstimate, size: int, memory: int) -> int:
    """The largest size at which every phase's peak, extrapolated on the line through ``size`` and twice it,
    stays within ``memory`` (NOTE [ Searching the largest batch ]).

    >>> one = ConfigEstimate("full", "full", 0, 0, 0, 0, 0, 0, 60, phase_bytes={"forward": 30, "backward": 60})
    >>> two = dataclasses.replace(one, phase_bytes={"forward": 40, "backward": 61})
    >>> _guess(one, two, 1, 100)  # forward's line (20 + 10 a size) reaches 100 first, at 8; backward's at 41
    8
    """
    phases = {phase: (row.phase_bytes[phase], twice.phase_bytes[phase])
              for phase in row.phase_bytes if phase in twice.phase_bytes} or {
        "step": (row.peak_bytes, twice.peak_bytes)}
    guess = None
    for first, second in phases.values():
        slope = (second - first) / size
        if slope > 0:
            at_most = size + int((memory - first) // slope)
            guess = at_most if guess is None else min(guess, at_most)
    return size if guess is None else guess


def largest_sizes(sample: Any, memory: int, batch_dim: int | None, seq_dim: int | None) -> Refine:
    """The `Refine` of `predict` that fills ``largest_batch`` and ``largest_seq`` (NOTE [ Searching the largest
    batch ])."""

    def refine(configured: Configured, row: ConfigEstimate, run: Callable[[Any], ConfigEstimate]) -> ConfigEstimate:
        batch = _search(row, sample, batch_dim, memory, run) if batch_dim is not None else None
        seq = _search(row, sample, seq_dim, memory, run) if seq_dim is not None else None
        return dataclasses.replace(row, largest_batch=batch, largest_seq=seq)

    return refine


def searches(sample: Any, memory: int | str | None, batch_dim: int | None, seq_dim: int | None) -> Refine | None:
    """The search of the largest batch and sequence for `estimate`, None without ``memory``; arguments checked."""
    dims = {"batch_dim": batch_dim, "seq_dim": seq_dim}
    for name, dim in dims.items():
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 0):
            raise TypeError(f"remat: estimate's `{name}` must be a dimension (an int >= 0), but got {dim!r}.")
        if dim is not None:
            size_along(sample, dim, name)
    if memory is None:
        if batch_dim is not None or seq_dim is not None:
            raise ValueError("remat: estimate's `batch_dim` and `seq_dim` go with `memory=` (the memory to fit the "
                             "largest batch in); give `memory` too.")
        return None
    if batch_dim is None and seq_dim is None:
        raise ValueError("remat: estimate with `memory=` searches the largest batch: give `batch_dim=` (and "
                         "`seq_dim=` for the sequence length), the dimension of the sample's tensors to grow.")
    return largest_sizes(sample, parse_memory(memory, "estimate's `memory`"), batch_dim, seq_dim)
