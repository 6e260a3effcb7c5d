"""Profile a model's blocks under each choice in one or a few real training steps: a `ModelCost`.

See NOTE [ Budget model ] in costs.py for what is measured.

NOTE [ Profiling rounds ]
A profile measures many (block, choice) pairs in each tracked training step, and derives what it need not run:
planning costs one tracked step with every block kept, and one block run alone to correct the clock.

Rules:
1. Full remat, `save_matmuls` and the choices that keep some matmuls (under the rerun strategy) are not run: they
   are derived from each block's run kept (NOTE [ Deriving choices ] and NOTE [ Some matmuls ] in derive.py). The
   choices that run are kept and those that cannot be derived (policies passed as `choices=`, and full remat
   under the replay strategy); where more than `_EARLY` of the bytes the blocks' forwards left alive died before
   the first backward, the derivable choices are run too.
2. Blocks of one kind (same class, same parameter shapes) cost the same wherever they sit, up to what lies around
   them. So one tracked step measures many (block, choice) pairs at once: each choice to run is run by two blocks
   of each kind, the other blocks kept; as many rounds run as the smallest kind needs to see every choice.
3. A block's numbers are split into what depends on its position (the bytes live at its forward start beyond
   what the blocks before it hold: the "base") and what it adds itself (its held bytes, its peaks above its
   start); the second part is the block's own where it ran (or was derived) under that choice, else the (upper)
   median over the blocks of its kind that did; the first is always the block's own (combine.py).
4. The same step also keeps the clock (NOTE [ Timing under the tracker ] in marks.py): times are the median over
   blocks of a kind.
5. Profiling leaves the model as it found it: the RNG streams, the buffers (BatchNorm statistics) and `.grad`.

Implementation notes:
1. (rule 2) With k choices to run, in round r the m-th block of a kind takes slot p = m + r * (size of its kind)
   and runs under the (p mod k)-th while p < 2k (two samples of each), kept after that. Two samples of each
   rather than a third of the blocks each: the rematerialized blocks are what makes the profiled step slower than
   a plain one.
2. (rules 1, 2) With only kept to run, that is one round whatever the kinds: one tracked step, every block kept,
   each recorded in detail for the derivations (marks.py's `Detail`). That step peaks at no remat's activation
   peak (running two blocks of each kind under save_matmuls and full remat keeps it below that, not by much):
   profiling needs the memory of a plain training step.
3. (rule 3) In each round, hooks mark where every block's forward and backward start and end (a forward pre-hook
   and hook; gradient hooks on its first input and first output tensor), and a tracker records the peak of every
   window between two marks. Outside windows give `outside_peaks` (the largest over rounds) and `outside_time`.
4. (rule 4) What planning costs in training steps is what `python -m benchmarks --model budget` prints (column
   "plan (steps)"; figures in docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from .._core.policies import save_matmuls
from .._engine.rng import devices_of
from .._engine.selective import SaveOps
from .._measure.clock import clock_for, priced
from .._measure.state import step_state
from .._measure.track import placed
from .alone import mode_alone, time_alone
from .combine import Round, combine
from .compiled_block import Shift, compiled_shifts, shifted
from .costs import ModelCost
from .derive import PARTS, Kept, mode_overhead
from .marks import Recorder, Step, marked_step

__all__ = ["profile_blocks"]

Assign = Callable[[int, int], None]  # put block i under choice c


def _kind(block: nn.Module) -> tuple[Any, ...]:
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())
    return (type(block), repr(block), params)


_EARLY = 0.05  # of the bytes blocks hold, dying before the first backward: then derived choices are run instead

_SAMPLES = 2  # blocks of a kind that run each choice in the profiled step, at most; see NOTE [ Profiling rounds ]


def _rounds(blocks: Sequence[nn.Module], run: Sequence[int]) -> list[list[int]]:
    """Per round, the choice of each block: the choices in `run` (indices), in turn over the blocks of a kind."""
    k = len(run)
    kinds = [_kind(b) for b in blocks]
    members: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i, kind in enumerate(kinds):
        members[kind].append(i)
    rank = {i: m for group in members.values() for m, i in enumerate(group)}
    size = {i: len(members[kind]) for i, kind in enumerate(kinds)}
    count = max(-(-k // len(group)) for group in members.values())
    slot = [[rank[i] + r * size[i] for i in range(len(blocks))] for r in range(count)]
    return [[run[p % k] if p < _SAMPLES * k else run[0] for p in row] for row in slot]


def profile_blocks(
    model: nn.Module,
    names: Sequence[str],
    blocks: Sequence[nn.Module],
    choices: Sequence[str],
    step: Step,
    assign: Assign,
    derived: Collection[int] = (),
    closed: Collection[int] = (),
    compiled: bool = False,
) -> ModelCost:
    """Profile `blocks` of `model` under every choice on the training step `step` (NOTE [ Profiling rounds ]).

    Args:
        model: the model that `step` runs (its RNG devices, buffers and gradients are left as they were).
        names: the blocks' qualified names, in forward order.
        blocks: the blocks themselves, in forward order.
        choices: labels of the choices, in the order `assign` numbers them; choice 0 keeps the block as it is.
        step: runs the model's forward on the sample and returns the scalar loss.
        assign: `assign(i, c)` puts block i under choice c (the caller applies or removes the hooks).
        derived: choices derived from the blocks' runs kept instead of run (labelled "full" or "save_matmuls",
            with the rerun strategy: NOTE [ Deriving choices ] in derive.py). The parts (`PARTS`, NOTE [ Some
            matmuls ]) can only be derived: where derivations do not hold, they are open to no block.
        closed: choices neither run nor derived: open to no block.
        compiled: price the derived choices for one compiled graph (NOTE [ Compiled costs ] in derive.py).

    Returns:
        The `ModelCost` of every block under every choice.
    """
    run = [c for c in range(len(choices)) if c not in derived and c not in closed]
    if derived and run[:1] != [0]:
        raise ValueError("remat: derived choices need choice 0 (kept) to be run.")
    rounds = _rounds(blocks, run)
    params = [p for p in model.parameters() if p.requires_grad]
    devices = devices_of(params, module=model)
    alone: dict[int, tuple[float, float]] = {}
    # gradients are outside the budget; RNG streams put back; fake tensors priced: NOTE [ Priced time ] in clock.py
    with clock_for([*model.parameters(), *model.buffers()]), step_state(model):
        exact = priced()  # the tracked step's times: nothing to correct them with
        apart = not exact and bool(placed(model))  # NOTE [ Timing under the tracker ] in marks.py
        samples = {} if apart or exact else _samples(blocks, rounds, len(run))
        tracked: list[Recorder] = []
        timed: list[Recorder] = []
        for assignment in rounds:
            for i, c in enumerate(assignment):
                assign(i, c)
            here = {b for r, b in samples.values() if r == len(tracked)}
            kept = [i for i, c in enumerate(assignment) if c == 0] if derived else []
            made = () if compiled else params  # one graph keeps every gradient: NOTE [ Compiled as one graph ]
            tracked.append(marked_step(step, blocks, True, not apart, devices, here, kept, made))
            timed.append(marked_step(step, blocks, False, True, devices) if apart else tracked[-1])
        again = derived and any(rec.early is not None and rec.early[1] > _EARLY * rec.early[0] for rec in tracked)
        for choice, (r, sample) in ({} if again else samples).items():  # no block timed alone for a profile redone
            assign(sample, choice)
            try:
                alone[choice] = time_alone(blocks[sample], tracked[r].specs[sample], devices)
            except Exception:  # only a refinement: NOTE [ Timing under the tracker ]
                alone.clear()
                break
        timing = alone and not compiled  # no dispatch mode runs in compiled code
        per_op = _per_op(blocks, choices, derived, tracked, samples, assign, devices) if timing else None
        if per_op is None:
            moded = not compiled and any(choices[c] != "full" for c in derived)
            per_op = mode_overhead() if moded else 0.0
        shifts: dict[int, Shift] = {}
        if compiled and not again and 0 in samples:  # NOTE [ Compiled bytes ] in compiled_block.py
            r, sample = samples[0]
            shifts = compiled_shifts(blocks[sample], tracked[r].specs[sample], [0, *derived, *run[1:]],
                                     lambda c: assign(sample, c))
    if again:
        parts = [c for c in derived if choices[c] in PARTS]  # NOTE [ Deriving choices ]: run the others
        return profile_blocks(model, names, blocks, choices, step, assign, closed=parts, compiled=compiled)
    sample_kind = _kind(blocks[next(iter(samples.values()))[1]]) if alone else None
    times_priced = exact
    kinds = [_kind(b) for b in blocks]
    measured = [_round(a, rec, _kept(rec)) for a, rec in zip(rounds, tracked, strict=True)]
    clocks = [_round(a, rec, {}) for a, rec in zip(rounds, timed, strict=True)]
    labels = {c: choices[c] for c in derived}
    cost = combine(names, kinds, choices, measured, clocks, alone, sample_kind, labels, per_op, compiled)
    cost = dataclasses.replace(cost, priced=times_priced)  # NOTE [ Priced time ]: relative, not this device's
    return shifted(cost, kinds, _kind(blocks[samples[0][1]]), shifts) if shifts else cost


def _per_op(
    blocks: Sequence[nn.Module], choices: Sequence[str], derived: Collection[int], tracked: Sequence[Recorder],
    samples: dict[int, tuple[int, int]], assign: Callable[[int, int], None], devices: Sequence[torch.device],
) -> float | None:
    """Seconds per op of `save_matmuls`' dispatch mode on the sample block kept: NOTE [ Mode cost in place ] in
    derive.py. None where no derived choice runs the mode, or the block cannot tell."""
    if 0 not in samples or all(choices[c] == "full" for c in derived):
        return None
    r, sample = samples[0]
    found = tracked[r].details.get(sample)
    if found is None or not found[0].ops:
        return None
    assign(sample, 0)
    try:
        added = mode_alone(blocks[sample], tracked[r].specs[sample], devices, lambda: SaveOps(save_matmuls))
    except Exception:  # only a refinement, as the block's own time alone
        return None
    return max(mode_overhead(), added / found[0].ops)


def _round(assignment: list[int], rec: Recorder, kept: dict[int, Kept]) -> Round:
    return Round(assignment, rec.held, rec.base, rec.peaks, rec.times, kept)


def _kept(rec: Recorder) -> dict[int, Kept]:
    out: dict[int, Kept] = {}
    for i, (detail, outputs) in rec.details.items():
        if i not in rec.at_backward:
            continue  # its backward never ran: nothing to derive from
        at, alive, live = rec.at_backward[i]
        h = rec.held[i]
        fwd = rec.peaks.get(("fwd", i), rec.base[i] + h)
        bwd = rec.peaks.get(("bwd", i), rec.base[i] + h)
        out[i] = Kept(rec.base[i], h, fwd, bwd, at, alive, frozenset(k for k, _ in outputs), live, detail)
    return out


def _samples(blocks: Sequence[nn.Module], rounds: list[list[int]], k: int) -> dict[int, tuple[int, int]]:
    """Per choice run, the first (round, block) in which a block of the largest kind runs it (run alone later)."""
    members: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i, block in enumerate(blocks):
        members[_kind(block)].append(i)
    largest = max(members.values(), key=len)
    out: dict[int, tuple[int, int]] = {}
    for r, assignment in enumerate(rounds):
        for b in largest:
            out.setdefault(assignment[b], (r, b))
    return out if len(out) == k else {}
