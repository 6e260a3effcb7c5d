"""Profile a model's blocks under each choice in one or a few real training steps: a `ModelCost`.

See NOTE [ Budget model ] in costs.py for what is measured, and NOTE [ Profiling rounds ]
Full remat, `save_matmuls` and the choices that keep some matmuls (under the rerun strategy) are not run: they
are derived from each block's run kept (NOTE [ Deriving choices ] and NOTE [ Some matmuls ] in derive.py), so
the choices that run are kept and those that cannot be derived (policies passed as `choices=`, and full remat
under the replay strategy). Blocks of one kind (same
class, same parameter shapes) cost the same wherever they sit, up to what lies around them. So one tracked
step measures many (block, choice) pairs at once: with k choices to run, in round r the m-th block of a kind
takes slot p = m + r * (size of its kind) and runs under the (p mod k)-th while p < 2k (two samples of each),
kept after that; as many rounds run as the smallest kind needs to see every choice. With only kept to run,
that is one round whatever the kinds: one tracked step, every block kept, each recorded in detail for the
derivations (windows.py's `Detail`). That step peaks at no remat's activation peak (running two blocks of
each kind under save_matmuls and full remat kept it near three quarters of that on the GPT-like stack):
profiling needs the memory of a plain training step. With more choices to run, two samples of each rather
than a third of the blocks each: the rematerialized blocks are what makes the profiled step slower than a
plain one. In each round, hooks mark where every block's forward and backward start and end (a forward
pre-hook and hook; gradient hooks on its first input and first output tensor), and a tracker records the peak
of every window between two marks.
A block's numbers are split into what depends on its position (the bytes live at its forward start beyond
what the blocks before it hold: the "base") and what it adds itself (its held bytes, its peaks above its
start); the second part is the block's own where it ran (or was derived) under that choice, else the (upper)
median over the blocks of its kind that did; the first is always the block's own (combine.py).
The same step also keeps the clock (NOTE [ Timing under the tracker ] in windows.py): times are the median over
blocks of a kind. Outside windows give `outside_peaks` (the largest over rounds) and `outside_time`. So
planning costs one tracked step with every block kept, and one block run alone to correct the clock: on the
benchmark's GPT-like stack and on its convnet (six blocks of five kinds) 1.4-1.8 training steps each
(measured on a loaded machine: `python -m remat --model budget --threads 1`, column "plan (steps)").
Profiling leaves the model as it found it: the RNG streams, the buffers (BatchNorm statistics) and `.grad`.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from .._engine.rng import devices_of
from .._engine.selective import SaveOps
from .._policies import save_matmuls
from .._torch_compat import tree_leaves
from .alone import describe, mode_alone, time_alone
from .combine import Round, combine
from .compiled_block import Shift, compiled_shifts, shifted
from .costs import ModelCost
from .derive import PARTS, Kept, mode_overhead
from .state import step_state
from .track import _storage, synchronize
from .windows import Detail, Windows, per_op_overhead

__all__ = ["profile_blocks"]

Step = Callable[[], torch.Tensor]  # runs the forward and returns the scalar loss
Assign = Callable[[int, int], None]  # put block i under choice c


class _Recorder:
    """The marks of one step: forward/backward start and end of each block (see NOTE [ Profiling rounds ])."""

    def __init__(self, n: int, tracker: Windows | None, timing: bool, devices: tuple[torch.device, ...]) -> None:
        self.n = n
        self.tracker = tracker
        self.timing = timing
        self.devices = devices
        self.owner: tuple[str, int] = ("out", 0)  # the window open now
        self.held_sum = 0  # bytes held by the blocks whose forward ended and backward has not
        self.held = [0] * n
        self.start_level = [0] * n
        self.base = [0] * n  # bytes live at block i's forward start beyond what blocks 0..i-1 hold
        self.peaks: dict[tuple[str, int], int] = {}
        self.times: dict[tuple[str, int], float] = defaultdict(float)
        self.clock = time.perf_counter()
        self.grad_events: dict[int, tuple[weakref.ref[torch.Tensor], list[tuple[int, int]]]] = {}
        self.describe: set[int] = set()  # blocks whose inputs to describe (see alone.py)
        self.specs: dict[int, tuple[Any, Any]] = {}
        self.detailed: set[int] = set()  # blocks to record in detail (NOTE [ Deriving choices ] in derive.py)
        # their forward, and its outputs' storages (weakly: NOTE [ Deriving choices ] in derive.py)
        self.details: dict[int, tuple[Detail, list[tuple[int, weakref.ref[torch.Tensor]]]]] = {}
        self.at_backward: dict[int, tuple[int, int, frozenset[int]]] = {}  # live, own live, outputs live
        self.early: tuple[int, int] | None = None  # at the first backward: bytes the others held, and lost since

    def _switch(self, owner: tuple[str, int]) -> int:
        if self.timing:
            synchronize(self.devices)
            now = time.perf_counter()
            overhead = self.tracker.take_overhead() if self.tracker is not None else 0.0
            self.times[self.owner] += max(0.0, now - self.clock - overhead)
        level = 0
        if self.tracker is not None:
            peak = self.tracker.mark()
            level = self.tracker.current_bytes
            kind, k = self.owner
            base = self.held_sum if kind == "out" else self.held_sum - self.held[k]  # S_k: NOTE [ Budget model ]
            self.peaks[self.owner] = max(self.peaks.get(self.owner, 0), peak - base)
        self.owner = owner
        if self.timing:
            self.clock = time.perf_counter()  # what the recorder does between windows counts in none
        return level

    def forward_start(self, i: int) -> None:
        self.start_level[i] = self._switch(("fwd", i))
        self.base[i] = self.start_level[i] - self.held_sum
        if self.tracker is not None and i in self.detailed:
            self.tracker.detail = Detail()

    def forward_end(self, i: int, output: Any) -> None:
        tracker = self.tracker
        if tracker is not None:
            detail = tracker.close()
            self.held[i] = max(0, tracker.current_bytes - self.start_level[i])
            self.held_sum += self.held[i]
            if detail is not None:
                outputs = [(detail.live[k], ref) for k, ref in _storage_keys(output) if k in detail.live]
                self.details[i] = (detail, outputs)
        self._switch(("out", i + 1))

    def backward_start(self, i: int) -> None:
        if self.owner[0] == "bwd" and self.owner[1] > i:  # a block after i never marked its end
            self.backward_end(self.owner[1])
        level = self._switch(("bwd", i))
        if self.tracker is not None and self.early is None and self.details:
            self.early = _early_deaths(self.tracker, [d for j, (d, _) in self.details.items() if j != i])
        if self.tracker is not None and i in self.details:
            detail, out = self.details[i]
            live = frozenset(self.tracker.still_live(detail, [n for n, ref in out if ref() is not None]))
            alive = sum(detail.born[n] for n in self.tracker.still_live(detail, detail.refs))
            self.at_backward[i] = (level - (self.held_sum - self.held[i]), alive, live)
            if self.timing:
                self.clock = time.perf_counter()

    def backward_end(self, i: int) -> None:
        if self.owner != ("bwd", i):
            return
        self._switch(("out", i))
        self.held_sum -= self.held[i]

    def on_grad(self, tensor: torch.Tensor, event: int, i: int) -> None:
        """Call backward_end(i) (event 0) or backward_start(i) (event 1) when `tensor`'s gradient is ready.

        Tensors are held weakly: a strong reference would keep every block's output alive to the end of the step.
        """
        entry = self.grad_events.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            events: list[tuple[int, int]] = []
            entry = (weakref.ref(tensor), events)
            self.grad_events[id(tensor)] = entry

            def hook(grad: torch.Tensor) -> None:
                for kind, block in sorted(events):  # ends before starts: the same tensor ends i and starts i-1
                    (self.backward_end if kind == 0 else self.backward_start)(block)

            tensor.register_hook(hook)  # type: ignore[no-untyped-call]
        entry[1].append((event, i))

    def finish(self) -> None:
        if self.owner[0] == "bwd":
            self.backward_end(self.owner[1])
        self._switch(("out", 0))
        self.grad_events.clear()


def _early_deaths(tracker: Windows, details: list[Detail]) -> tuple[int, int]:
    """Bytes these blocks' forwards left alive, and how many of them died before the first backward started.

    NOTE [ Budget model ] has a block hold what its forward left alive until its own backward; where the
    blocks' storages die sooner (something outside or a later block frees them), the bytes measured above
    S_i depend on the choices around the block, and NOTE [ Deriving choices ] cannot hold.
    """
    held = lost = 0
    for detail in details:
        numbers = list(detail.refs)
        alive = set(tracker.still_live(detail, numbers))
        for number in numbers:
            held += detail.born[number]
            if number not in alive:
                lost += detail.born[number]
    return held, lost


def _storage_keys(value: Any) -> list[tuple[int, weakref.ref[torch.Tensor]]]:
    """The storage key of every tensor in `value` that has a storage, with a weak reference to the tensor."""
    out = []
    for t in tree_leaves(value):
        storage = _storage(t) if isinstance(t, torch.Tensor) else None
        if storage is not None:
            out.append((storage._cdata, weakref.ref(t)))
    return out


def _first_grad_tensor(value: Any) -> torch.Tensor | None:
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return leaf
    return None


def _hooks(blocks: Sequence[nn.Module], recorder: _Recorder) -> list[Any]:
    handles: list[Any] = []
    for i, block in enumerate(blocks):

        def pre(module: nn.Module, args: Any, kwargs: Any, i: int = i) -> None:
            if i in recorder.describe:
                recorder.specs[i] = describe(args, kwargs)
            recorder.forward_start(i)
            first = _first_grad_tensor((args, kwargs))
            if first is not None and torch.is_grad_enabled():
                recorder.on_grad(first, 0, i)

        def post(module: nn.Module, args: Any, kwargs: Any, output: Any = None, i: int = i) -> None:
            recorder.forward_end(i, output)
            first = _first_grad_tensor(output)
            if first is not None:
                recorder.on_grad(first, 1, i)

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True, always_call=True))
    return handles


def _run(
    step: Step,
    blocks: Sequence[nn.Module],
    tracked: bool,
    timing: bool,
    devices: tuple[torch.device, ...],
    describe: Collection[int] = (),
    detailed: Collection[int] = (),
) -> _Recorder:
    """One step with window marks: tracked for bytes, timed, or both (NOTE [ Timing under the tracker ])."""
    with contextlib.ExitStack() as stack:
        tracker: Windows | None = None
        if tracked:
            tracker = Windows()
            stack.enter_context(tracker)
            tracker.per_op = per_op_overhead() if timing else 0.0
        recorder = _Recorder(len(blocks), tracker, timing, devices)
        recorder.describe = set(describe)
        recorder.detailed = set(detailed)
        handles = _hooks(blocks, recorder)
        try:
            if timing:
                synchronize(devices)
                if tracker is not None:
                    tracker.take_overhead()
                recorder.clock = time.perf_counter()
            torch.autograd.backward(step())
            recorder.finish()
        finally:
            for handle in handles:
                handle.remove()
    return recorder


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
    apart = any(d.type != "cpu" for d in devices)  # NOTE [ Timing under the tracker ] in windows.py
    samples = {} if apart else _samples(blocks, rounds, len(run))
    alone: dict[int, tuple[float, float]] = {}
    with step_state(model):  # gradients are outside the budget; RNG streams put back
        tracked: list[_Recorder] = []
        timed: list[_Recorder] = []
        for assignment in rounds:
            for i, c in enumerate(assignment):
                assign(i, c)
            here = {b for r, b in samples.values() if r == len(tracked)}
            kept = [i for i, c in enumerate(assignment) if c == 0] if derived else []
            tracked.append(_run(step, blocks, True, not apart, devices, here, kept))
            timed.append(_run(step, blocks, False, True, devices) if apart else tracked[-1])
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
        shifts: dict[int, Shift] = {}
        if compiled and not again and 0 in samples:  # NOTE [ Compiled bytes ] in compiled_block.py
            r, sample = samples[0]
            shifts = compiled_shifts(blocks[sample], tracked[r].specs[sample], [0, *derived, *run[1:]],
                                     lambda c: assign(sample, c))
    if again:
        parts = [c for c in derived if choices[c] in PARTS]  # NOTE [ Deriving choices ]: run the others
        return profile_blocks(model, names, blocks, choices, step, assign, closed=parts, compiled=compiled)
    sample_kind = _kind(blocks[next(iter(samples.values()))[1]]) if alone else None
    kinds = [_kind(b) for b in blocks]
    measured = [_round(a, rec, _kept(rec)) for a, rec in zip(rounds, tracked, strict=True)]
    clocks = [_round(a, rec, {}) for a, rec in zip(rounds, timed, strict=True)]
    labels = {c: choices[c] for c in derived}
    if per_op is None:
        per_op = mode_overhead() if not compiled and any(label != "full" for label in labels.values()) else 0.0
    cost = combine(names, kinds, choices, measured, clocks, alone, sample_kind, labels, per_op, compiled)
    return shifted(cost, kinds, _kind(blocks[samples[0][1]]), shifts) if shifts else cost


def _per_op(
    blocks: Sequence[nn.Module], choices: Sequence[str], derived: Collection[int], tracked: Sequence[_Recorder],
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


def _round(assignment: list[int], rec: _Recorder, kept: dict[int, Kept]) -> Round:
    return Round(assignment, rec.held, rec.base, rec.peaks, rec.times, kept)


def _kept(rec: _Recorder) -> dict[int, Kept]:
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
