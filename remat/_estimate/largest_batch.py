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
3. With ``seq_dim`` the same search runs along the sequence at the sample's batch size. Its answer is the memory's
   alone: where the model holds a table of learned positions (`position_table`: GPT-2's `wpe`), a longer
   sequence cannot run, and the report says so beside an answer above it.

4. Where the step's peak is affine in the size (wherever no tensor grows with its square: attention that keeps
   no sequence x sequence tensor, no materialized mask), a few estimates give the answer, not a search: each phase's
   peak (forward, backward, the optimizer step) lies on a line, the answer is where the first of them reaches
   ``memory``, and one estimate at that size checks it. Where the check fails, the lines are drawn again through
   the last two sizes; where it keeps failing (a peak that is not affine), the bisection of rule 2 runs from
   there. The answer is then exact to within `TOLERANCE` of itself.
5. Where the model's blocks are identical layers in one container (a decoder's layers) and the configuration runs
   them alike (not a budget's plan; one process's whole model, not a rank's), the lines of rule 4 are drawn from
   models cut to their first `DEPTHS` layers: each phase's peak is affine in the number of identical layers too, so
   two cut models' steps give the whole model's at any size, for the cost of a few layers. The lines are drawn,
   and drawn again, as in rule 4, on these; then one estimate of the whole model at the answer checks it as rule
   4's check does. Where the cut models do not give the whole model's peak at the sample's size, or the check
   fails, the whole model's search of rule 4 runs.
6. Where the configuration runs the identical layers of rule 5 alike, backward's peak is followed in parts split
   at those layers rather than whole: backward up to the last layer's (the head and the loss), the last layer's,
   and from the first layer's on. Each is affine in the size and in the depth where backward's whole peak is not
   (it is the largest of them), and the layers between peak at most as high as the larger end; a size whose
   backward peaks between them by more than rule 4's tolerance fails the check.
7. A guess is accepted only where the lines through the last two sizes estimated (the guess the second) cross
   ``memory`` at the guess itself; else the lines are drawn again through those two.

Implementation notes:
1. (rule 2) The bisection doubles its step from a first guess until one size fits and the next does not bracket
   the answer, then halves the bracket; a bad guess costs a few more estimates.
2. (rule 4) The lines: a step's peak is the largest of several lines (early in backward the activations dominate,
   late in backward the gradients, the optimizer step holds no activations), and at small sizes the steep one is
   often not yet the highest, so extrapolating the whole step's peak (flat there) guesses far too high; the peak
   of each phase is followed instead. Within a phase the moment that peaks can change with the size too (the end
   of backward, with the gradients, at small sizes; its start, with every block's kept input, at large ones): the
   line through the sample's size and twice it then falls short of the peak at the answer, which the check sees
   (the peak there is off the line), and the next lines are drawn through sizes near the answer.
3. (rule 4) The check accepts a size that fits whose phase peaks lie on the lines within `TOLERANCE` of the
   size's own growth (the bytes its peak adds over the sample's): the lines then put the next size over
   ``memory``, and the true answer is within that tolerance of it.
4. (rule 5) A phase's peak is the largest of several lines in depth as in size (the gradients of every layer
   against the inputs every layer keeps): two cut models can agree on a line the whole model has left. The check
   at full depth sees it; the cut models save the estimates of the whole model that rule 4 spends on drawing the
   lines (each few layers' step costs a fraction of the whole's), not the check.
5. (rule 5) The cut models' steps at the sample's own size, on the sample itself as the whole model's row, are the
   same whichever dimension a search grows: the largest batch's search and the longest sequence's share them.
6. (rule 6) While layer k of L is differentiated, the identical layers' part of what is alive is A + a.(k+1) +
   g.(L-k-1): the kept inputs and activations of the layers not yet differentiated, the gradients of those done.
   Its largest value over k is at one end, k = L-1 (every layer's activations, as a large size or no remat has
   them) or k = 0 (every other layer's gradients, as a small size or a deep model has them), each affine in L and
   in the size; the lines through the whole backward (their maximum) bend where the two cross, which cost the
   search of rule 4 its rounds, and the cut models of rule 5 their agreement where no remat crosses between the
   cut models' depth and the whole model's. The head's part is apart from the last layer's for the same reason
   (the loss's chunks against a layer's recompute). The parts are split by hooks on the last, the second-to-last
   and the first layer's outputs (NOTE [ Who holds the peak ] in phases.py, implementation note 2); the check of
   rule 4 also compares backward's whole peak with its parts', so a model whose layers between peak higher falls
   back.
7. (rule 7) A step's peak is affine only up to rounding (tiles and chunks of a whole number of positions): lines
   drawn through a far size put a guess that checks within `TOLERANCE` a little off where lines through two sizes
   near it put it; the second lines decide, so the answer does not depend on how far the first guess was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._core.errors import BudgetError
from .._core.torch_compat import tree_leaves
from .._core.units import parse_memory
from .._measure.fake import map_sample
from .phases import BACKWARD, FIRST_LAYER, HEAD, LAST_LAYER
from .predict import Configured, Refine, Rerun
from .report import ConfigEstimate

__all__ = [
    "AGREE", "CAP", "DEPTHS", "ROUNDS", "TOLERANCE", "largest", "largest_sizes", "position_table", "resized",
    "searches", "size_along",
]

CAP = 1 << 20
"""The largest size searched for."""

TOLERANCE = 0.01
"""How far off its lines a checked size's peak may be, as a share of its growth (NOTE [ Searching the largest
batch ], implementation note 3)."""

ROUNDS = 3
"""How many times the lines are drawn again before the bisection takes over (rule 4)."""

DEPTHS = (2, 3)
"""The depths of the cut models whose steps are drawn out to the whole model's depth (rule 5)."""

AGREE = 1e-4
"""How far the cut models' phase peaks at the sample's size may be from the whole model's, as a share of its peak,
for the cut models to be tried (rule 5)."""


_POSITION_TABLES = ("wpe", "position_embeddings", "embed_positions", "positions_embed", "position_embedding",
                    "pos_embed", "pos_emb")
"""The names transformers (and GPT-like code) give a table of learned positions."""

_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "n_ctx")


def position_table(model: nn.Module) -> tuple[str, int] | None:
    """The model's table of learned positions and how many positions it holds, or None (rotary, relative or no
    positions: no table bounds the sequence). Its rows, or fewer where the model's config says so (OPT's table has
    two rows more than its `max_position_embeddings`).

    >>> class GPT(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.wte, self.wpe = nn.Embedding(50, 8), nn.Embedding(16, 8)
    >>> position_table(GPT())
    ('wpe', 16)
    """
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES:
            rows = module.num_embeddings
            config = getattr(model, "config", None)
            said = [getattr(config, key, None) for key in _POSITION_LIMITS]
            return name, min([rows, *(n for n in said if isinstance(n, int) and not isinstance(n, bool) and n > 0)])
    return None


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


def _search(row: ConfigEstimate, sample: Any, dim: int, memory: int, run: Rerun,
            at_sample: dict[int, ConfigEstimate | None]) -> int:
    """The largest size along ``dim`` that fits; ``at_sample`` holds the cut models' rows at the sample's own size,
    which every search of the configuration shares (implementation note 5)."""
    size = size_along(sample, dim, "dim")  # checked by `estimate` before any step runs
    seen: dict[int, ConfigEstimate | None] = {size: None if row.refused is not None else row}

    def at(n: int) -> ConfigEstimate | None:
        if n not in seen:
            try:
                got: ConfigEstimate | None = run(resized(sample, dim, size, n))
            except BudgetError:
                got = None
            seen[n] = None if got is None or got.refused is not None else got
        return seen[n]

    def fits(n: int) -> bool:
        got = at(n)
        return got is not None and got.peak_bytes <= memory

    if not fits(size):
        return largest(fits, size)
    found = _in_depth(at, fits, size, memory, sample, dim, run, at_sample) if run.layer_count is not None else None
    if found is None:
        found = _affine(at, fits, size, memory)
    if found is not None:
        return found
    return largest(fits, max(n for n in seen if fits(n)))  # rule 2, from the largest size seen to fit


def _affine(at: Callable[[int], ConfigEstimate | None], fits: Callable[[int], bool], size: int,
            memory: int) -> int | None:
    """The answer of NOTE [ Searching the largest batch ], rule 4, or None where the peak is not affine enough."""
    first, second = size, min(2 * size, CAP)
    for _ in range(ROUNDS):
        low, high = at(first), at(second)
        if low is None or high is None or second == first:
            return None
        lines = _lines(_phases(low), first, _phases(high), second)
        guess = _crossing(lines, memory)
        if guess is None:  # no phase grows: as large as searched for, if it fits there
            return CAP if fits(CAP) else None
        guess = max(1, min(guess, CAP))
        got = at(guess)
        sample_row = at(size)
        if guess != size and got is not None and got.peak_bytes <= memory and _checked(
                got, guess, lines, sample_row.peak_bytes if sample_row is not None else 0) and _settled(
                _phases(high), second, _phases(got), guess, memory):
            return guess
        first, second = (second, guess) if guess != second else (first, guess)
    return None


def _in_depth(at: Callable[[int], ConfigEstimate | None], fits: Callable[[int], bool], size: int, memory: int,
              sample: Any, dim: int, run: Rerun, at_sample: dict[int, ConfigEstimate | None]) -> int | None:
    """The answer of NOTE [ Searching the largest batch ], rule 5, or None where the cut models do not give it."""
    layers = run.layer_count
    assert layers is not None
    shallow, deep = DEPTHS
    if layers < 2 * deep:  # cut models save little on a shallow model
        return None
    seen: dict[int, dict[str, float] | None] = {}

    def extrapolated(n: int) -> dict[str, float] | None:  # each phase's peak of the whole model, from two cut ones
        if n not in seen:
            rows = []
            for depth in DEPTHS:
                if n == size and depth in at_sample:
                    got = at_sample[depth]
                else:
                    try:  # at the sample's own size, the sample itself, as the whole model's row
                        got = run(sample if n == size else resized(sample, dim, size, n), depth)
                    except BudgetError:
                        got = None
                    if n == size:
                        at_sample[depth] = got
                if got is None or got.refused is not None:
                    seen[n] = None
                    return None
                rows.append(_phases(got))
            a, b = rows
            seen[n] = {phase: a[phase] + (b[phase] - a[phase]) * (layers - shallow) / (deep - shallow)
                       for phase in a.keys() & b.keys()}
        return seen[n]

    whole = at(size)
    assert whole is not None  # it fits
    low = extrapolated(size)
    if low is None or not _agree(low, _phases(whole), whole.peak_bytes) or not _at_the_ends(
            whole, AGREE * whole.peak_bytes):
        return None  # the layers' bytes do not add up in depth: the whole model's search
    first, second = size, min(2 * size, CAP)
    for _ in range(ROUNDS):
        a, b = extrapolated(first), extrapolated(second)
        if a is None or b is None or second == first:
            return None
        lines = _lines(a, first, b, second)
        guess = _crossing(lines, memory)
        if guess is None:
            return None
        guess = max(1, min(guess, CAP))
        cut = extrapolated(guess)
        if cut is None:
            return None
        if guess != size and max(cut.values()) <= memory and _on_lines(cut, guess, lines, whole.peak_bytes) \
                and _settled(b, second, cut, guess, memory):
            got = at(guess)  # the check at full depth
            if got is not None and got.peak_bytes <= memory and _checked(got, guess, lines, whole.peak_bytes):
                return guess
            return None
        first, second = (second, guess) if guess != second else (first, guess)
    return None


def _agree(got: dict[str, float], want: dict[str, int], peak: int) -> bool:
    """Whether the cut models' phase peaks are the whole model's, within `AGREE` of its ``peak``."""
    return got.keys() == want.keys() and all(abs(got[p] - want[p]) <= AGREE * peak for p in want)


_Line = tuple[float, float]  # bytes at size 0, bytes per unit of size


_ENDS = (HEAD, LAST_LAYER, FIRST_LAYER)  # backward's parts whose peaks the lines follow (rule 6)


def _phases(row: ConfigEstimate) -> dict[str, int]:
    """The peaks the lines follow: each phase's, backward's as its parts where the row has them (rule 6)."""
    if all(part in row._parts for part in _ENDS):
        phases = {phase: n for phase, n in row.phase_bytes.items() if phase != BACKWARD}
        return {**phases, **{part: row._parts[part] for part in _ENDS}}
    return dict(row.phase_bytes) if row.phase_bytes else {"step": row.peak_bytes}


def _at_the_ends(row: ConfigEstimate, slack: float) -> bool:
    """Whether backward peaks in one of the parts the lines follow, within ``slack`` bytes, where they follow them
    (rule 6, implementation note 6): else the peak is off every line."""
    ends = [row._parts[part] for part in _ENDS if part in row._parts]
    return len(ends) < len(_ENDS) or row.phase_bytes.get(BACKWARD, 0) <= max(ends) + slack


def _lines(a: Mapping[str, float], first: int, b: Mapping[str, float], second: int) -> dict[str, _Line]:
    """Each phase's peak on the line through two sizes (implementation note 2)."""
    lines = {}
    for phase in a.keys() & b.keys():
        slope = (b[phase] - a[phase]) / (second - first)
        lines[phase] = (a[phase] - slope * first, slope)
    return lines


def _settled(a: Mapping[str, float], first: int, b: Mapping[str, float], second: int, memory: int) -> bool:
    """Whether the lines through the last two sizes estimated (``first`` with peaks ``a``, then ``second``, the
    guess) cross ``memory`` at ``second`` itself (rule 7, implementation note 7).

    >>> _settled({"backward": 0.0}, 0, {"backward": 90.0}, 9, 100)  # ten a size: they reach 100 at 10, not at 9
    False
    >>> _settled({"backward": 0.0}, 0, {"backward": 100.0}, 10, 100)
    True
    """
    return first == second or _crossing(_lines(a, first, b, second), memory) == second


def _crossing(lines: dict[str, _Line], memory: int) -> int | None:
    """The largest size at which no growing line exceeds ``memory``; None when none grows.

    >>> _crossing({"forward": (20.0, 10.0), "backward": (59.0, 1.0)}, 100)  # forward reaches 100 first, at 8
    8
    """
    found = None
    for start, slope in lines.values():
        if slope > 0:
            at_most = int((memory - start) // slope)
            found = at_most if found is None else min(found, at_most)
    return found


def _on_lines(phases: Mapping[str, float], n: int, lines: dict[str, _Line], sample_peak: int) -> bool:
    """Whether each phase's peak at ``n`` is on its line within `TOLERANCE` of the growth since the sample's size
    (its peak ``sample_peak``: implementation note 3)."""
    growth = max(1.0, max(phases.values()) - sample_peak)
    return all(abs(phases[phase] - (start + slope * n)) <= TOLERANCE * growth
               for phase, (start, slope) in lines.items() if phase in phases)


def _checked(row: ConfigEstimate, n: int, lines: dict[str, _Line], sample_peak: int) -> bool:
    """The check of a size's estimate (``row``, at size ``n``): its peaks on the lines, and backward's at one of its
    ends where the lines follow them, within `TOLERANCE` of the growth since the sample's size (implementation
    notes 3 and 6)."""
    phases = _phases(row)
    growth = max(1.0, max(phases.values()) - sample_peak)
    return _on_lines(phases, n, lines, sample_peak) and _at_the_ends(row, TOLERANCE * growth)


def largest_sizes(sample: Any, memory: int, batch_dim: int | None, seq_dim: int | None) -> Refine:
    """The `Refine` of `predict` that fills ``largest_batch`` and ``largest_seq`` (NOTE [ Searching the largest
    batch ])."""

    def refine(configured: Configured, row: ConfigEstimate, run: Rerun) -> ConfigEstimate:
        at_sample: dict[int, ConfigEstimate | None] = {}
        batch = _search(row, sample, batch_dim, memory, run, at_sample) if batch_dim is not None else None
        seq = _search(row, sample, seq_dim, memory, run, at_sample) if seq_dim is not None else None
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
