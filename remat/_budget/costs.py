"""Stage 2, costs: what a model's blocks cost under each way of rematerializing them, made from what the profile
measured, and the records that join the stages.

The stages are joined by plain records, so that either side can be swapped: the profile (profile.py) fills a
`Profile`, on a fake twin of the model or on the real one; `measured_costs` turns it into a `ModelCost` (bytes and
times of every block under every choice, measured or derived: costs_derived.py); the mode adds the gradients
(`with_gradients`: NOTE [ Gradients in the budget ]); and solve.py chooses one option per block under a budget,
never touching a tensor.

NOTE [ Budget model ]
A training step runs blocks 0..n-1 in order in forward and in reverse in backward; a plan's peak and time follow
from numbers measured per block, and the order of the blocks is the whole coupling between them.

Rules:
1. Block i under choice c leaves `held_bytes` h alive at the end of its forward (what it keeps for backward, its
   output included) until its backward.
2. While block i runs (forward or backward, recompute included), the blocks before it still hold what they kept,
   S_i = sum of h_j for j < i, and the blocks after it hold nothing more in backward: so every number below is
   counted *above* S_i:
     peak while block i runs forward   = S_i + forward_peak(i, c)
     peak while block i runs backward  = S_i + backward_peak(i, c)
     peak outside every block when blocks 0..k-1 hold their bytes (before block 0, between blocks, after the last
     forward and through the loss, after block 0's backward) = S_k + outside_peaks[k], for k = 0..n
3. The step's peak is the largest of these; its time is `outside_time` plus every block's forward and backward
   time.
4. The model is additive: what a block costs does not depend on the choices of the others.

Implementation notes:
1. (rule 2) Bytes are live tensor storage bytes beyond those live before the step (parameters and their gradients
   are outside them).
2. (rule 4) A block's output is kept alive by the next block whatever that block's choice, so it counts in h.
   Where the blocks' forwards leave less alive than this assumes, the profile runs the choices instead of
   deriving them (NOTE [ Deriving choices ] in costs_derived.py).

NOTE [ Outside inputs ]
A tensor made outside the blocks and read by them (a 4-D attention mask that every decoder layer takes, position
ids) is alive through forward, held by the model's own code; whether it lives on through backward depends on the
choices, not on one block: kept, a block saves it for backward only if one of its ops does (an attention mask added
to the scores is not saved), while a rematerialized block holds every input it takes until its own backward, to
run again. With eager attention the mask is a float per batch row and pair of positions, as large as one head's
scores.

Rules:
1. The profile notes, per tracked step, the inputs of the blocks that were made outside every block's forward and
   are dead when backward starts with every block that takes them kept (`outside_inputs`: bytes, and the blocks
   that take them). Inputs some kept block saves, or that outlive forward for any other reason, are in the
   measured windows already, and the blocks' own outputs are in their held bytes (rule 1 of NOTE [ Budget model ]).
2. Under a plan, such an input is alive from the end of forward until the backward of the first block (in forward
   order) that takes it under a choice other than kept has run: so it adds its bytes to that block's backward peak
   and to every block's after it, to the windows outside the blocks after it (the loss's among them), and to
   nothing in forward, where it is alive under every plan and measured.
3. This couples blocks (two rematerialized blocks that take one mask hold it once), so it is not in the additive
   model: the solver carries which inputs are held as part of its state (NOTE [ Block recurrence ] in solve.py).
   Inputs that the same blocks take are one group; past `_INPUT_GROUPS` groups, the smallest are merged into one
   taken by all their blocks (an overestimate).

Implementation notes:
1. (rule 1) `Windows.outside_born` holds the storages allocated while no block's forward window was open; a block's
   forward pre-hook notes those among its inputs (`Marks.note_inputs` in profile_step.py), and the first backward
   mark keeps those that died (`_dead_inputs` in profile.py). A step where a block that takes one was not kept
   does not say (it holds it): only steps where all of them ran kept count, and the largest bytes per group are
   kept; a profile that runs the derivable choices after its kept step (NOTE [ Deriving choices ], rule 2) keeps
   the kept step's.
2. (rule 2) The windows outside the blocks are one peak each for forward and backward; the input is added to the
   whole, an overestimate where the window's forward part is the larger.

NOTE [ Gradients in the budget ]
Rules:
1. A budget bounds what a step allocates as the device counts it (`remat.track()`, or
   `torch.cuda.max_memory_allocated()` minus what was allocated before the step): gradients that backward makes
   count, gradients that already exist do not (an in-place accumulation allocates nothing that lives on).
2. A plan assumes the loop almost everyone writes: `optimizer.zero_grad()` sets gradients to None, so every
   backward allocates each parameter's gradient when it reaches that parameter, and it lives to the step's end.
   A loop that keeps its gradients (`zero_grad(set_to_none=False)`, accumulation) peaks lower, never higher.
3. The profile itself runs without new gradients (each parameter has a zero `.grad` that backward adds into:
   `step_state`), so what a block costs does not depend on where it sits. Inside each window of the profile, a
   parameter's gradient counts from the moment backward first accumulates it (where a default loop's backward
   would make it) to the window's end; the gradients made before a window are added here, by position, from the
   order in which the profiled backward reached the parameters.

Implementation notes:
1. `accumulation_order` (profile.py) records the parameters in the order their gradients were first accumulated
   (a post-accumulate-grad hook); every round of a profile runs the same backward order, so the first-seen order
   is the first round's. `gradient_steps` turns it into bytes by position while the profile still runs (on a fake
   twin, the parameters it reached are the twin's).
2. A window's own gradients are in its measured peak (`Windows.made` in profile_step.py, at the first accumulation of
   each parameter in the step). Added here: while block i runs backward, the gradients of every parameter
   accumulated before block i's first; in the window between block k's backward and block k-1's
   (`outside_peaks[k]`, which also covers the forward between them, where no gradient exists yet), those
   accumulated up to block k's last; in window 0 (after block 0's backward), the same up to block 0's last; in
   window n (the head, the loss and their backward) none. A block without parameters takes the bounds of the
   next block below it that has some.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .costs_derived import changed_calls, compiled_times, derive_bytes, derive_times, output_calls, part_calls
from .profile import PARTS, GradientSteps, KeptRun, Profile
from .profile_alone import Shift

__all__ = ["BlockCost", "ModelCost", "OutsideInput", "measured_costs", "shifted", "with_gradients"]

KEPT = "kept"
"""The label of the choice that leaves a block as it is (choice 0 of a profile): every other choice holds the block's
inputs for its backward (NOTE [ Outside inputs ])."""

_INPUT_GROUPS = 4  # groups of outside inputs the solver tells apart; the rest merged (NOTE [ Outside inputs ])


class OutsideInput(NamedTuple):
    """Tensors made outside the blocks that `users` take and nothing keeps for backward (NOTE [ Outside inputs ])."""

    nbytes: int
    users: frozenset[int]



@dataclass(frozen=True)
class BlockCost:
    """What one block costs under one choice (see NOTE [ Budget model ]).

    Args:
        held_bytes: bytes its forward leaves alive for its backward, its output included.
        forward_peak: the peak while its forward runs, in bytes above what the blocks before it hold.
        backward_peak: the peak while its backward runs, recompute included, above the same.
        forward_time: seconds of its forward.
        backward_time: seconds of its backward, recompute included.

    >>> BlockCost(held_bytes=4096, forward_peak=8192, backward_peak=12288, forward_time=0.01, backward_time=0.02)
    BlockCost(held_bytes=4096, forward_peak=8192, backward_peak=12288, forward_time=0.01, backward_time=0.02)
    """

    held_bytes: int
    forward_peak: int
    backward_peak: int
    forward_time: float
    backward_time: float

    def __post_init__(self) -> None:
        for name in ("held_bytes", "forward_peak", "backward_peak"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"remat: BlockCost.{name} must be an int >= 0 (bytes), but got {value!r}.")
        for name in ("forward_time", "backward_time"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"remat: BlockCost.{name} must be a finite number >= 0, but got {value!r}.")

    @property
    def need(self) -> int:
        """The larger of the two peaks: the room this block needs above what the blocks before it hold."""
        return max(self.forward_peak, self.backward_peak)

    @property
    def time(self) -> float:
        """Forward and backward time together."""
        return self.forward_time + self.backward_time


@dataclass(frozen=True)
class ModelCost:
    """The costs of every block of a model under every choice, and of what runs outside the blocks.

    Args:
        names: the blocks' qualified names, in forward order.
        choices: the choices' labels, e.g. ("kept", "save_matmuls", "full").
        blocks: `blocks[i][c]` is block i's cost under choice c, or None where that choice is not open to it.
        outside_peaks: n + 1 numbers; see NOTE [ Budget model ].
        outside_time: seconds of the step spent outside the blocks.
        calls: `calls[i][c]`, for a choice that keeps some of block i's matmul-class calls (NOTE [ Some matmuls ]
            in costs_derived.py), which of them; None for every other; empty: none such anywhere.
        priced: the times are ops priced on a nominal device (a profile on fake tensors: NOTE [ Priced time ] in
            remat/_measure/clock.py), good for comparing plans with each other, not as seconds of this device.
        outside_inputs: what a rematerialized block holds beyond its own bytes (NOTE [ Outside inputs ]).

    >>> kept, full = BlockCost(8, 12, 16, 1.0, 2.0), BlockCost(1, 12, 20, 1.0, 3.0)
    >>> cost = ModelCost(("0", "1"), ("kept", "full"), ((kept, full), (kept, full)), (0, 0, 4), 0.5)
    >>> len(cost), cost.choices
    (2, ('kept', 'full'))
    """

    names: tuple[str, ...]
    choices: tuple[str, ...]
    blocks: tuple[tuple[BlockCost | None, ...], ...]
    outside_peaks: tuple[int, ...]
    outside_time: float = 0.0
    calls: tuple[tuple[frozenset[int] | None, ...], ...] = ()
    priced: bool = False
    outside_inputs: tuple[OutsideInput, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.names)
        for found in self.outside_inputs:
            if found.nbytes < 0 or not found.users or not all(0 <= i < n for i in found.users):
                raise ValueError(f"remat: an outside input of a ModelCost of {n} blocks needs bytes >= 0 and blocks "
                                 f"among them, but got {found!r}.")
        if self.calls and len(self.calls) != n:
            raise ValueError(f"remat: a ModelCost of {n} blocks needs {n} rows of calls, but got {len(self.calls)}.")
        if len(self.blocks) != n or len(self.outside_peaks) != n + 1:
            raise ValueError(
                f"remat: a ModelCost of {n} blocks needs {n} rows of costs and {n + 1} outside peaks, but got "
                f"{len(self.blocks)} and {len(self.outside_peaks)}."
            )
        for i, row in enumerate(self.blocks):
            if len(row) != len(self.choices):
                raise ValueError(
                    f"remat: block {self.names[i]!r} has {len(row)} costs for {len(self.choices)} choices."
                )
            if all(c is None for c in row):
                raise ValueError(f"remat: block {self.names[i]!r} has no choice open to it.")

    def __len__(self) -> int:
        return len(self.names)


# -- from a profile to costs: `measured_costs`, its steps in the order they run -----------------------------------

Entry = tuple[int, int, int]  # held bytes, forward peak above base, backward peak above base + held


@dataclass
class _Bytes:
    """What the tracked rounds say of the blocks' bytes (NOTE [ Profiling rounds ] in profile.py, rule 3).

    Attributes:
        base: per block, the most bytes live at its forward start beyond what the blocks before it held.
        own: per block and choice, what it adds itself where it ran under that choice or was derived.
        of_kind: per kind and choice, every `own` entry of the blocks of that kind.
        parts: per kind and part, the matmul-class calls the part keeps, or None where it is not offered (NOTE
            [ Some matmuls ] in costs_derived.py).
        part_times: per kind and part, the seconds of those calls in each run kept.
        matmul: per kind, the seconds of all matmul-class calls in each run kept.
        unchanged: per kind, the seconds of those whose output the block did not change in place (what `save_matmuls`
            keeps in eager code: NOTE [ Deriving choices ] in costs_derived.py).
        ops: per kind, the ops of each run kept.
        unread: per block, the bytes of its outputs no later op read (NOTE [ Outputs no one reads ] in
            costs_derived.py), the largest over its runs kept.
    """

    base: list[int]
    unread: list[int]
    own: dict[tuple[int, int], Entry] = field(default_factory=dict)
    of_kind: defaultdict[tuple[Any, int], list[Entry]] = field(default_factory=lambda: defaultdict(list))
    parts: dict[tuple[Any, int], frozenset[int] | None] = field(default_factory=dict)
    part_times: defaultdict[tuple[Any, int], list[float]] = field(default_factory=lambda: defaultdict(list))
    matmul: defaultdict[Any, list[float]] = field(default_factory=lambda: defaultdict(list))
    unchanged: defaultdict[Any, list[float]] = field(default_factory=lambda: defaultdict(list))
    ops: defaultdict[Any, list[float]] = field(default_factory=lambda: defaultdict(list))


def measured_costs(profile: Profile) -> ModelCost:
    """The `ModelCost` of what `profile` measured, before the gradients (the mode adds them): each block's bytes
    under each choice it ran or was derived under (else the median of its kind's), the times of its kind, scaled
    by the runs alone, and what lies outside the blocks; a compiled profile's shifts applied last."""
    found = _bytes(profile)
    scale, outside_scale = _clock_scale(profile)
    seconds = _seconds(profile, found, scale)
    rows = tuple(_row(profile, found, seconds, i) for i in range(len(profile.names)))
    outside = [max(rnd.peaks.get(("out", k), 0) for rnd in profile.tracked) for k in range(len(profile.names) + 1)]
    outside[-1] += found.unread[-1] if found.unread else 0  # NOTE [ Outputs no one reads ] in costs_derived.py
    outside_time = statistics.median(
        sum(v for key, v in rnd.times.items() if key[0] == "out") for rnd in profile.timed
    )
    calls = tuple(
        tuple(found.parts.get((profile.kinds[i], c)) if row[c] is not None else None for c in range(len(row)))
        for i, row in enumerate(rows)
    )
    cost = ModelCost(profile.names, profile.choices, rows, tuple(outside), max(0.0, outside_time * outside_scale),
                     calls, priced=profile.priced, outside_inputs=_outside_inputs(profile.outside_inputs))
    return shifted(cost, profile.kinds, profile.sample_kind, profile.shifts) if profile.shifts else cost


def _outside_inputs(groups: Mapping[frozenset[int], int]) -> tuple[OutsideInput, ...]:
    """The profile's outside inputs (NOTE [ Outside inputs ]), largest first, the smallest groups merged past
    `_INPUT_GROUPS`.

    >>> _outside_inputs({frozenset({0, 1}): 16, frozenset({1}): 8, frozenset({0}): 0})
    (OutsideInput(nbytes=16, users=frozenset({0, 1})), OutsideInput(nbytes=8, users=frozenset({1})))
    """
    ordered = sorted(((users, nbytes) for users, nbytes in groups.items() if nbytes),
                     key=lambda item: (-item[1], sorted(item[0])))
    if len(ordered) > _INPUT_GROUPS:
        rest = ordered[_INPUT_GROUPS - 1:]
        merged = (frozenset().union(*(users for users, _ in rest)), sum(nbytes for _, nbytes in rest))
        ordered = [*ordered[:_INPUT_GROUPS - 1], merged]
    return tuple(OutsideInput(nbytes, users) for users, nbytes in ordered)


def _bytes(profile: Profile) -> _Bytes:
    """Each block's own bytes under every choice it ran, and under the derived ones where it ran kept."""
    found = _Bytes(base=[0] * len(profile.names), unread=[0] * len(profile.names))
    for rnd in profile.tracked:
        for i, c in enumerate(rnd.choice):
            b, h = rnd.base[i], rnd.held[i]
            found.base[i] = max(found.base[i], b)
            forward, backward = rnd.peaks.get(("fwd", i), b + h), rnd.peaks.get(("bwd", i), b + h)
            entries = {c: (h, forward - b, backward - b - h)}
            kept = rnd.kept.get(i)
            if kept is not None:
                entries.update(_derived(profile, found, profile.kinds[i], kept, b))
                unread = sum(kept.detail.born[n] for n in kept.outputs - kept.read_outputs)
                found.unread[i] = max(found.unread[i], unread)
            for choice, entry in entries.items():
                found.own[(i, choice)] = entry
                found.of_kind[(profile.kinds[i], choice)].append(entry)
    return found


def _derived(profile: Profile, found: _Bytes, kind: Any, kept: KeptRun, base: int) -> dict[int, Entry]:
    """The derived choices' entries of a block from its run kept; records the run's matmul times and the parts'
    calls (chosen once per kind, from the first of its kind recorded kept: NOTE [ Some matmuls ])."""
    times = kept.detail.call_time
    changed = set() if profile.compiled else changed_calls(kept.detail)  # NOTE [ Compiled costs ]
    found.matmul[kind].append(sum(times))
    found.unchanged[kind].append(sum(t for call, t in enumerate(times) if call not in changed))
    found.ops[kind].append(kept.detail.ops)
    entries: dict[int, Entry] = {}
    for d, label in profile.derived.items():
        calls = None
        if label in PARTS:
            if (kind, d) not in found.parts:
                chosen = _part(PARTS[label], kept, changed)
                same = any(found.parts.get((kind, e)) == chosen for e in profile.derived if e < d)
                found.parts[(kind, d)] = None if same else chosen  # a part twice is offered once
            calls = found.parts[(kind, d)]
            if calls is None:
                continue  # keeps nothing or everything: not offered
            found.part_times[(kind, d)].append(sum(times[call] for call in calls if call < len(times)))
        held, forward, backward = derive_bytes(label, kept, calls, profile.compiled)
        entries[d] = (held, forward - base, backward - base - held)
    return entries


def _part(share: float, kept: KeptRun, changed: set[int]) -> frozenset[int] | None:
    """The calls a part keeps, or None where that is none or all it may (NOTE [ Some matmuls ]); never one of
    `changed` (`changed_calls`)."""
    calls = part_calls(share, kept.detail, kept.outputs, changed)
    may = len(kept.detail.call_time) - len(output_calls(kept.detail, kept.outputs) | changed)
    return calls if 0 < len(calls) < may else None


def _clock_scale(profile: Profile) -> tuple[list[tuple[float, float]], float]:
    """Per choice, how much faster its forward and backward ran alone than tracked, and the same over all choices
    run for the time outside the blocks (NOTE [ Timing under the tracker ] in profile_step.py); 1 without runs
    alone."""
    scale = [(1.0, 1.0)] * len(profile.choices)
    if not profile.alone:
        return scale, 1.0
    times = _times(profile)
    for choice, (forward, backward) in profile.alone.items():
        tracked_forward, tracked_backward = times[(profile.sample_kind, choice)]
        scale[choice] = (_speedup(forward, statistics.median(tracked_forward)),
                         _speedup(backward, statistics.median(tracked_backward)))
    outside = _speedup(
        sum(f + b for f, b in profile.alone.values()),
        sum(sum(map(statistics.median, times[(profile.sample_kind, choice)])) for choice in profile.alone),
    )
    return scale, outside


def _times(profile: Profile) -> defaultdict[tuple[Any, int], tuple[list[float], list[float]]]:
    """Per kind and choice run, the forward and the backward seconds of each of its blocks in the timed rounds."""
    times: defaultdict[tuple[Any, int], tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for rnd in profile.timed:
        for i, c in enumerate(rnd.choice):
            times[(profile.kinds[i], c)][0].append(rnd.times.get(("fwd", i), 0.0))
            times[(profile.kinds[i], c)][1].append(rnd.times.get(("bwd", i), 0.0))
    return times


def _speedup(alone: float, tracked: float) -> float:
    """How much faster a run alone was than under the tracker, between 0.5 and 1."""
    return 1.0 if tracked <= 0 else min(1.0, max(0.5, alone / tracked))


Seconds = dict[tuple[Any, int], tuple[float, float]]  # per kind and choice: forward and backward


def _seconds(profile: Profile, found: _Bytes, scale: list[tuple[float, float]]) -> Seconds:
    """Per kind and choice, forward and backward seconds: the median of the runs, scaled; a derived choice's from
    its kind's runs kept (NOTE [ Deriving choices ], NOTE [ Compiled costs ] in costs_derived.py)."""
    seconds = {
        key: (statistics.median(forward) * scale[key[1]][0], statistics.median(backward) * scale[key[1]][1])
        for key, (forward, backward) in _times(profile).items()
    }
    for kind, matmul in found.matmul.items():
        if (kind, 0) not in seconds:
            continue
        forward, backward = seconds[(kind, 0)]
        for d, label in profile.derived.items():
            kept_time = found.part_times.get((kind, d), matmul) if label in PARTS else found.unchanged[kind]
            if not kept_time:
                continue
            if profile.compiled:
                every = statistics.median(matmul) * scale[0][0]
                keeps = statistics.median(kept_time) * scale[0][0] if label in PARTS else every
                seconds[(kind, d)] = compiled_times(label, forward, backward, every, keeps)
            else:
                seconds[(kind, d)] = derive_times(label, forward, backward, statistics.median(kept_time) * scale[0][0],
                                                  statistics.median(found.ops[kind]), profile.per_op)
    return seconds


def _row(profile: Profile, found: _Bytes, seconds: Seconds, i: int) -> tuple[BlockCost | None, ...]:
    """Block i's cost under each choice: its own bytes, else the median of its kind's; None where neither ran nor
    was derived (not open to it)."""
    row: list[BlockCost | None] = []
    kind = profile.kinds[i]
    for c in range(len(profile.choices)):
        entry = found.own.get((i, c))
        if entry is None and found.of_kind.get((kind, c)):
            entry = _median(found.of_kind[(kind, c)])
        if entry is None:
            row.append(None)
            continue
        held, forward_peak, backward_peak = entry
        forward, backward = seconds.get((kind, c), (0.0, 0.0))
        before = found.unread[i - 1] if i else 0  # alive through this forward: NOTE [ Outputs no one reads ]
        row.append(BlockCost(
            held_bytes=held,
            forward_peak=max(0, found.base[i] + forward_peak) + before,
            backward_peak=max(0, found.base[i] + held + backward_peak),
            forward_time=forward,
            backward_time=backward,
        ))
    return tuple(row)


def _median(entries: list[Entry]) -> Entry:
    ordered = [sorted(column) for column in zip(*entries, strict=True)]
    middle = len(entries) // 2
    return (ordered[0][middle], ordered[1][middle], ordered[2][middle])


# -- what the costs add to a profile's: gradients, and a compiled block's bytes ------------------------------------

def with_gradients(cost: ModelCost, steps: GradientSteps) -> ModelCost:
    """`cost` with the gradients alive at each point of the step added to its peaks.

    >>> block = BlockCost(held_bytes=8, forward_peak=12, backward_peak=16, forward_time=1.0, backward_time=2.0)
    >>> cost = ModelCost(("0", "1"), ("kept",), ((block,), (block,)), (0, 0, 4))
    >>> new = with_gradients(cost, GradientSteps((64, 40), (64, 40, 16)))
    >>> [row[0].backward_peak for row in new.blocks], new.outside_peaks
    ([80, 56], (64, 40, 20))
    """
    n = len(cost.names)
    if len(steps.blocks) != n or len(steps.outside) != n + 1:
        raise ValueError(f"remat: {n} blocks need {n} and {n + 1} gradient sizes, but got "
                         f"{len(steps.blocks)} and {len(steps.outside)}.")
    blocks = tuple(
        tuple(None if c is None else dataclasses.replace(c, backward_peak=c.backward_peak + steps.blocks[i])
              for c in row)
        for i, row in enumerate(cost.blocks)
    )
    peaks = tuple(peak + steps.outside[k] for k, peak in enumerate(cost.outside_peaks))
    return dataclasses.replace(cost, blocks=blocks, outside_peaks=peaks)


def shifted(cost: ModelCost, kinds: Sequence[Any], kind: Any, shifts: Mapping[int, Shift]) -> ModelCost:
    """`cost` with the blocks of `kind` shifted by `shifts` per choice, never below zero (NOTE [ Compiled bytes ] in
    costs_compiled.py).

    >>> cost = ModelCost(("0",), ("kept",), ((BlockCost(8, 12, 16, 1.0, 2.0),),), (0, 0))
    >>> shifted(cost, ["mlp"], "mlp", {0: (-2, 0, -20)}).blocks[0][0]
    BlockCost(held_bytes=6, forward_peak=12, backward_peak=0, forward_time=1.0, backward_time=2.0)
    """

    def one(c: int, block: BlockCost | None) -> BlockCost | None:
        if block is None or c not in shifts:
            return block
        held, forward, backward = shifts[c]
        return dataclasses.replace(
            block,
            held_bytes=max(0, block.held_bytes + held),
            forward_peak=max(0, block.forward_peak + forward),
            backward_peak=max(0, block.backward_peak + backward),
        )

    rows = tuple(
        tuple(one(c, b) for c, b in enumerate(row)) if kinds[i] == kind else row for i, row in enumerate(cost.blocks)
    )
    return dataclasses.replace(cost, blocks=rows)
