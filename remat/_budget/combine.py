"""Turn the marks of profiled steps into a `ModelCost`: per block and choice, measured or derived.

See NOTE [ Profiling rounds ] in profile.py for how the rounds run, NOTE [ Deriving choices ] in derive.py for the
choices that are derived from a block's run kept rather than run, and NOTE [ Timing under the tracker ] in
marks.py for how the times of runs alone scale the tracked ones.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .costs import BlockCost, ModelCost
from .derive import PARTS, Kept, compiled_times, derive_bytes, derive_times, output_calls, part_calls

__all__ = ["Round", "combine"]


@dataclass(frozen=True)
class Round:
    """What one profiled step measured (see `Recorder` in marks.py).

    Args:
        assignment: the choice each block ran under.
        held: per block, the bytes its forward left alive.
        base: per block, the bytes live at its forward start beyond what the blocks before it held.
        peaks: per window (("fwd" | "bwd" | "out", index)), its peak above what the blocks before it held.
        times: per window, its seconds.
        kept: per block that ran kept and was recorded in detail, what derivations start from.
    """

    assignment: Sequence[int]
    held: Sequence[int]
    base: Sequence[int]
    peaks: Mapping[tuple[str, int], int]
    times: Mapping[tuple[str, int], float]
    kept: Mapping[int, Kept] = field(default_factory=dict)


Entry = tuple[int, int, int]  # held bytes, forward peak above base, backward peak above base + held


def _median(entries: list[Entry]) -> Entry:
    ordered = [sorted(column) for column in zip(*entries, strict=True)]
    middle = len(entries) // 2
    return (ordered[0][middle], ordered[1][middle], ordered[2][middle])


def _ratio(alone: float, tracked: float) -> float:
    """How much faster a run alone was than under the tracker, between 0.5 and 1."""
    return 1.0 if tracked <= 0 else min(1.0, max(0.5, alone / tracked))


def combine(
    names: Sequence[str],
    kinds: Sequence[Any],
    choices: Sequence[str],
    tracked: Sequence[Round],
    timed: Sequence[Round],
    alone: Mapping[int, tuple[float, float]],
    sample_kind: Any,
    derived: Mapping[int, str],
    per_op: float,
    compiled: bool = False,
) -> ModelCost:
    """The `ModelCost` of rounds `tracked` (bytes) and `timed` (times; the same rounds on CPU).

    Args:
        names: the blocks' qualified names.
        kinds: per block, its kind (blocks of one kind cost the same up to where they sit).
        choices: the choices' labels.
        tracked, timed: the rounds, in the same order.
        alone: per choice run, a block of kind `sample_kind` timed alone (forward, backward), or nothing.
        sample_kind: the kind of that block.
        derived: the choices derived rather than run, index to label.
        per_op: seconds per op of `save_matmuls`' dispatch mode.
        compiled: price derived choices for one compiled graph (NOTE [ Compiled costs ] in derive.py).
    """
    n = len(names)
    # What a block adds itself under a choice: its own measurement, else the median over its kind; its base.
    own: dict[tuple[int, int], Entry] = {}
    samples: dict[tuple[Any, int], list[Entry]] = defaultdict(list)
    details: dict[Any, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))  # matmul seconds, ops
    parts: dict[tuple[Any, int], frozenset[int] | None] = {}  # per kind, the calls a part keeps: NOTE [ Some matmuls ]
    part_times: dict[tuple[Any, int], list[float]] = defaultdict(list)
    base = [0] * n
    for rnd in tracked:
        for i, c in enumerate(rnd.assignment):
            b = rnd.base[i]
            base[i] = max(base[i], b)
            h = rnd.held[i]
            fwd = rnd.peaks.get(("fwd", i), b + h)
            bwd = rnd.peaks.get(("bwd", i), b + h)
            entries = {c: (h, fwd - b, bwd - b - h)}
            kept = rnd.kept.get(i)
            if kept is not None:
                details[kinds[i]][0].append(sum(kept.detail.call_time))
                details[kinds[i]][1].append(kept.detail.ops)
                for d, label in derived.items():
                    calls = None
                    if label in PARTS:
                        if (kinds[i], d) not in parts:
                            found = _part(PARTS[label], kept)
                            same = any(parts.get((kinds[i], e)) == found for e in derived if e < d)
                            parts[(kinds[i], d)] = None if same else found  # a part twice is offered once
                        calls = parts[(kinds[i], d)]
                        if calls is None:
                            continue  # keeps nothing or everything: not offered
                        part_times[(kinds[i], d)].append(sum(kept.detail.call_time[c] for c in calls
                                                             if c < len(kept.detail.call_time)))
                    hd, fd, bd = derive_bytes(label, kept, calls)
                    entries[d] = (hd, fd - b, bd - b - hd)
            for choice, measured in entries.items():
                own[(i, choice)] = measured
                samples[(kinds[i], choice)].append(measured)
    times: dict[tuple[Any, int], tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for rnd in timed:
        for i, c in enumerate(rnd.assignment):
            times[(kinds[i], c)][0].append(rnd.times.get(("fwd", i), 0.0))
            times[(kinds[i], c)][1].append(rnd.times.get(("bwd", i), 0.0))
    scale = [(1.0, 1.0)] * len(choices)  # per choice, forward and backward: NOTE [ Timing under the tracker ]
    outside_scale = 1.0
    if alone:
        for choice, (fwd_alone, bwd_alone) in alone.items():
            fwd_times, bwd_times = times[(sample_kind, choice)]
            scale[choice] = (
                _ratio(fwd_alone, statistics.median(fwd_times)),
                _ratio(bwd_alone, statistics.median(bwd_times)),
            )
        outside_scale = _ratio(
            sum(f + b for f, b in alone.values()),
            sum(sum(map(statistics.median, times[(sample_kind, choice)])) for choice in alone),
        )
    seconds: dict[tuple[Any, int], tuple[float, float]] = {}
    for (kind, c), (fwd_times, bwd_times) in times.items():
        seconds[(kind, c)] = (statistics.median(fwd_times) * scale[c][0], statistics.median(bwd_times) * scale[c][1])
    for kind, (matmul, ops) in details.items():
        if (kind, 0) not in seconds:
            continue
        forward, backward = seconds[(kind, 0)]
        for d, label in derived.items():
            kept_time = part_times.get((kind, d), matmul) if label in PARTS else matmul
            if not kept_time:
                continue
            if compiled:
                every = statistics.median(matmul) * scale[0][0]
                keeps = statistics.median(kept_time) * scale[0][0] if label in PARTS else every
                seconds[(kind, d)] = compiled_times(label, forward, backward, every, keeps)
                continue
            seconds[(kind, d)] = derive_times(
                label, forward, backward, statistics.median(kept_time) * scale[0][0], statistics.median(ops), per_op
            )
    rows: list[tuple[BlockCost | None, ...]] = []
    for i in range(n):
        row: list[BlockCost | None] = []
        for c in range(len(choices)):
            entry: Entry | None = own.get((i, c))
            if entry is None and samples.get((kinds[i], c)):
                entry = _median(samples[(kinds[i], c)])
            if entry is None:
                row.append(None)  # neither run nor derived: not open to this block
                continue
            h, f, b = entry
            forward, backward = seconds.get((kinds[i], c), (0.0, 0.0))
            row.append(
                BlockCost(
                    held_bytes=h,
                    forward_peak=max(0, base[i] + f),
                    backward_peak=max(0, base[i] + h + b),
                    forward_time=forward,
                    backward_time=backward,
                )
            )
        rows.append(tuple(row))
    outside = [max(rnd.peaks.get(("out", k), 0) for rnd in tracked) for k in range(n + 1)]
    outside_time = statistics.median(sum(v for key, v in rnd.times.items() if key[0] == "out") for rnd in timed)
    kept_calls = tuple(
        tuple(parts.get((kinds[i], c)) if row[c] is not None else None for c in range(len(choices)))
        for i, row in enumerate(rows)
    )
    return ModelCost(
        tuple(names), tuple(choices), tuple(rows), tuple(outside), max(0.0, outside_time * outside_scale), kept_calls
    )


def _part(share: float, kept: Kept) -> frozenset[int] | None:
    """The calls a part keeps, or None where that is none or all it may (NOTE [ Some matmuls ])."""
    calls = part_calls(share, kept.detail, kept.outputs)
    may = len(kept.detail.call_time) - len(output_calls(kept.detail, kept.outputs))
    return calls if 0 < len(calls) < may else None
