"""Profile a model's blocks under each choice in one or a few real training steps: a `ModelCost`.

See NOTE [ Budget model ] in costs.py for what is measured, and NOTE [ Profiling rounds ] for how.

NOTE [ Profiling rounds ]
Blocks of one kind (same class, same parameter shapes) cost the same wherever they sit, up to what lies
around them. So one tracked step measures many (block, choice) pairs at once: in round r, the m-th block of
a kind takes slot p = m + r * (size of its kind) and runs under choice p mod k while p < 2k (two samples of
each choice), under choice 0 (kept, in remat.apply: the cheapest to run) after that; as many rounds run as
the smallest kind needs to see every choice (one round for a stack of 12 identical layers and 3 choices: two
blocks under each of save_matmuls and full remat, eight kept). Two samples rather than a third of the blocks
each: the rematerialized blocks are what makes the profiled step slower than a plain one (bytes do not
need more samples; times are scaled by a run alone anyway), at the price of a profiled step that holds more
memory (on the benchmark's GPT-like stack, by its own figures, about three quarters of no remat's peak rather
than about half). In each round, hooks mark where every block's forward and backward start and end (a forward
pre-hook and hook; gradient hooks on its first input and first output tensor), and a tracker records the peak
of every window between two marks.
A block's numbers are split into what depends on its position (the bytes live at its forward start beyond
what the blocks before it hold: the "base") and what it adds itself (its held bytes, its peaks above its
start); the second part is the block's own where it ran under that choice, else the (upper) median over the
blocks of its kind that did; the first is always the block's own.
The same step also keeps the clock (NOTE [ Timing under the tracker ] in windows.py): times are the median over
blocks of a kind. Outside windows give `outside_peaks` (the largest over rounds) and `outside_time`. So
planning a stack of identical layers costs one training step with four of its blocks rematerialized, the
tracker's cost, and k blocks run alone: about 1.9 training steps for the benchmark's GPT-like stack.
Profiling leaves the model as it found it: the RNG streams, the buffers (BatchNorm statistics) and `.grad`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .._engine.rng import RngStash, devices_of
from .alone import describe, time_alone
from .costs import BlockCost, ModelCost
from .track import synchronize
from .windows import Windows, per_op_overhead

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

    def forward_end(self, i: int) -> None:
        if self.tracker is not None:
            self.held[i] = max(0, self.tracker.current_bytes - self.start_level[i])
            self.held_sum += self.held[i]
        self._switch(("out", i + 1))

    def backward_start(self, i: int) -> None:
        if self.owner[0] == "bwd" and self.owner[1] > i:  # a block after i never marked its end
            self.backward_end(self.owner[1])
        self._switch(("bwd", i))

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
            recorder.forward_end(i)
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


_SAMPLES = 2  # blocks of a kind that run each choice in the profiled step, at most; see NOTE [ Profiling rounds ]


def _rounds(blocks: Sequence[nn.Module], k: int) -> list[list[int]]:
    kinds = [_kind(b) for b in blocks]
    members: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i, kind in enumerate(kinds):
        members[kind].append(i)
    rank = {i: m for group in members.values() for m, i in enumerate(group)}
    size = {i: len(members[kind]) for i, kind in enumerate(kinds)}
    count = max(-(-k // len(group)) for group in members.values())
    slot = [[rank[i] + r * size[i] for i in range(len(blocks))] for r in range(count)]
    return [[p % k if p < _SAMPLES * k else 0 for p in row] for row in slot]


def profile_blocks(
    model: nn.Module,
    names: Sequence[str],
    blocks: Sequence[nn.Module],
    choices: Sequence[str],
    step: Step,
    assign: Assign,
) -> ModelCost:
    """Profile `blocks` of `model` under every choice on the training step `step` (NOTE [ Profiling rounds ]).

    Args:
        model: the model that `step` runs (its RNG devices, buffers and gradients are left as they were).
        names: the blocks' qualified names, in forward order.
        blocks: the blocks themselves, in forward order.
        choices: labels of the choices, in the order `assign` numbers them.
        step: runs the model's forward on the sample and returns the scalar loss.
        assign: `assign(i, c)` puts block i under choice c (the caller applies or removes the hooks).

    Returns:
        The `ModelCost` of every block under every choice.
    """
    k = len(choices)
    rounds = _rounds(blocks, k)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = devices_of(params, module=model)
    apart = any(d.type != "cpu" for d in devices)  # NOTE [ Timing under the tracker ] in windows.py
    samples = {} if apart else _samples(blocks, rounds, k)
    alone: dict[int, tuple[float, float]] = {}
    try:
        for p in params:
            p.grad = torch.zeros_like(p)  # accumulate in place: gradients are outside the budget
        with RngStash.capture(devices).restore():
            tracked: list[_Recorder] = []
            timed: list[_Recorder] = []
            for assignment in rounds:
                for i, c in enumerate(assignment):
                    assign(i, c)
                here = {b for r, b in samples.values() if r == len(tracked)}
                tracked.append(_run(step, blocks, True, not apart, devices, here))
                timed.append(_run(step, blocks, False, True, devices) if apart else tracked[-1])
            for choice, (r, sample) in samples.items():
                assign(sample, choice)
                try:
                    alone[choice] = time_alone(blocks[sample], tracked[r].specs[sample], devices)
                except Exception:  # only a refinement: NOTE [ Timing under the tracker ]
                    alone.clear()
                    break
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    sample_kind = _kind(blocks[next(iter(samples.values()))[1]]) if alone else None
    return _costs(names, blocks, choices, rounds, tracked, timed, alone, sample_kind)


def _samples(blocks: Sequence[nn.Module], rounds: list[list[int]], k: int) -> dict[int, tuple[int, int]]:
    """Per choice, the first (round, block) in which a block of the largest kind runs it (run alone later)."""
    members: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i, block in enumerate(blocks):
        members[_kind(block)].append(i)
    largest = max(members.values(), key=len)
    out: dict[int, tuple[int, int]] = {}
    for r, assignment in enumerate(rounds):
        for b in largest:
            out.setdefault(assignment[b], (r, b))
    return out if len(out) == k else {}


def _median(entries: list[tuple[int, int, int]]) -> tuple[int, int, int]:
    ordered = [sorted(column) for column in zip(*entries, strict=True)]
    middle = len(entries) // 2
    return (ordered[0][middle], ordered[1][middle], ordered[2][middle])


def _costs(
    names: Sequence[str],
    blocks: Sequence[nn.Module],
    choices: Sequence[str],
    rounds: list[list[int]],
    tracked: list[_Recorder],
    timed: list[_Recorder],
    alone: dict[int, tuple[float, float]],
    sample_kind: tuple[Any, ...] | None,
) -> ModelCost:
    n = len(blocks)
    kinds = [_kind(b) for b in blocks]
    # What a block adds itself under a choice: its own measurement, else the median over its kind; its base.
    own: dict[tuple[int, int], tuple[int, int, int]] = {}
    samples: dict[tuple[Any, int], list[tuple[int, int, int]]] = defaultdict(list)
    base = [0] * n
    for assignment, rec in zip(rounds, tracked, strict=True):
        for i, c in enumerate(assignment):
            base[i] = max(base[i], rec.base[i])
            h = rec.held[i]
            fwd = rec.peaks.get(("fwd", i), rec.base[i] + h)
            bwd = rec.peaks.get(("bwd", i), rec.base[i] + h)
            entry = (h, fwd - rec.base[i], bwd - rec.base[i] - h)
            own[(i, c)] = entry
            samples[(kinds[i], c)].append(entry)
    times: dict[tuple[Any, int], tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for assignment, rec in zip(rounds, timed, strict=True):
        for i, c in enumerate(assignment):
            times[(kinds[i], c)][0].append(rec.times.get(("fwd", i), 0.0))
            times[(kinds[i], c)][1].append(rec.times.get(("bwd", i), 0.0))
    scale = [(1.0, 1.0)] * len(choices)  # per choice, forward and backward: NOTE [ Timing under the tracker ]
    outside_scale = 1.0
    if alone:
        for choice, (fwd_alone, bwd_alone) in alone.items():
            fwd_times, bwd_times = times[(sample_kind, choice)]
            scale[choice] = (
                _ratio(fwd_alone, statistics.median(fwd_times)), _ratio(bwd_alone, statistics.median(bwd_times))
            )
        outside_scale = _ratio(
            sum(f + b for f, b in alone.values()),
            sum(sum(map(statistics.median, times[(sample_kind, choice)])) for choice in alone),
        )
    rows: list[tuple[BlockCost | None, ...]] = []
    for i in range(n):
        row: list[BlockCost | None] = []
        for c in range(len(choices)):
            h, f, b = own.get((i, c)) or _median(samples[(kinds[i], c)])
            fwd_times, bwd_times = times.get((kinds[i], c), ([], []))
            row.append(
                BlockCost(
                    held_bytes=h,
                    forward_peak=max(0, base[i] + f),
                    backward_peak=max(0, base[i] + h + b),
                    forward_time=statistics.median(fwd_times) * scale[c][0] if fwd_times else 0.0,
                    backward_time=statistics.median(bwd_times) * scale[c][1] if bwd_times else 0.0,
                )
            )
        rows.append(tuple(row))
    outside = [max(rec.peaks.get(("out", k), 0) for rec in tracked) for k in range(n + 1)]
    outside_time = statistics.median(
        sum(v for key, v in rec.times.items() if key[0] == "out") for rec in timed
    )
    return ModelCost(tuple(names), tuple(choices), tuple(rows), tuple(outside), max(0.0, outside_time * outside_scale))


def _ratio(alone: float, tracked: float) -> float:
    """How much faster a run alone was than under the tracker, between 0.5 and 1."""
    return 1.0 if tracked <= 0 else min(1.0, max(0.5, alone / tracked))
