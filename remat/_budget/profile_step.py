"""The profile's instrument: one training step with marks where each block's forward and backward start and end
(NOTE [ Profiling rounds ] in profile.py), tracked for bytes, timed, or both (NOTE [ Timing under the tracker ]).

A forward pre-hook and hook on each block and gradient hooks on its first input and first output tensor switch
the tracker's window (`Windows`); `Marks` keeps each window's peak and clock, the blocks' inputs described for a
run alone (`describe_args` in profile_alone.py), and for the blocks recorded in detail (run kept, to derive their other
choices) what their forward allocated and which of it was still alive when backward started (`Detail`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .._core.policies import matmuls, save_matmuls
from .._core.torch_compat import tree_leaves
from .._engine.recorder import op_info
from .._engine.selective import SaveOps
from .._measure.clock import MODE_PER_OP, now, priced
from .._measure.fake import FakeTracker
from .._measure.step_autocast import cached_cast
from .._measure.track import _storage, synchronize
from .profile_alone import describe_args

__all__ = ["Detail", "Marks", "Step", "Windows", "marked_step", "mode_cost", "mode_overhead", "per_op_overhead"]


Step = Callable[[], torch.Tensor]  # runs the forward and returns the scalar loss


class Marks:
    """The marks of one step: forward/backward start and end of each block (NOTE [ Profiling rounds ] in
    profile.py), and what each window between two marks measured."""

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
        self.clock = now()
        self.grad_events: dict[int, tuple[weakref.ref[torch.Tensor], list[tuple[int, int]]]] = {}
        self.describing: set[int] = set()  # blocks whose inputs to describe (profile_alone.py)
        self.specs: dict[int, tuple[Any, Any]] = {}
        self.detailed: set[int] = set()  # blocks to record in detail (NOTE [ Deriving choices ] in costs_derived.py)
        # their forward, and its outputs' storages (weakly: NOTE [ Deriving choices ] in costs_derived.py)
        self.details: dict[int, tuple[Detail, list[tuple[int, weakref.ref[torch.Tensor]]]]] = {}
        self.at_backward: dict[int, tuple[int, int, frozenset[int]]] = {}  # live, own live, outputs live
        self.early: tuple[int, int] | None = None  # at the first backward: bytes the others held, and lost since
        self.made: set[int] = set()  # parameters whose gradient this step's backward has made (`gradient_made`)
        # the blocks' inputs made outside every block, until the first backward: key -> bytes, reference, blocks
        self.inputs: dict[int, tuple[int, object, set[int]]] = {}
        self.outside_inputs: tuple[tuple[int, frozenset[int]], ...] | None = None  # at the first backward

    def _switch(self, owner: tuple[str, int]) -> int:
        if self.timing:
            synchronize(self.devices)
            tick = now()
            overhead = self.tracker.take_overhead() if self.tracker is not None else 0.0
            self.times[self.owner] += max(0.0, tick - self.clock - overhead)
        level = 0
        if self.tracker is not None:
            peak = self.tracker.mark()
            level = self.tracker.current_bytes
            kind, k = self.owner
            base = self.held_sum if kind == "out" else self.held_sum - self.held[k]  # S_k: NOTE [ Budget model ]
            self.peaks[self.owner] = max(self.peaks.get(self.owner, 0), peak - base)
        self.owner = owner
        if self.tracker is not None:
            self.tracker.in_block = owner[0] == "fwd"
        if self.timing:
            self.clock = now()  # the marks' own work between windows counts in none
        return level

    def note_inputs(self, i: int, args: Any, kwargs: Any) -> None:
        """Note the tensors block i takes that were made outside every block (NOTE [ Outside inputs ] in costs.py)."""
        tracker = self.tracker
        if tracker is None or self.outside_inputs is not None:  # a recompute in backward: noted already
            return
        for key in _storages_read(args, kwargs):
            entry = tracker.born_outside(key)
            if entry is None:
                continue
            found = self.inputs.get(key)
            if found is None or found[1] is not entry[1]:  # a storage freed and its key used again: another
                found = self.inputs[key] = (*entry, set())
            found[2].add(i)

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
                keys = [(k, ref) for k, ref in _storage_keys(output) if k in detail.live]
                outputs = [(detail.live[k], ref) for k, ref in keys]
                self.details[i] = (detail, outputs)
                if self.outside_inputs is None:  # forward: which of them a later op reads (`KeptRun.read_outputs`)
                    tracker.watched.update((k, (i, detail.live[k])) for k, _ in keys)
        self._switch(("out", i + 1))

    def backward_start(self, i: int) -> None:
        if self.owner[0] == "bwd" and self.owner[1] > i:  # a block after i never marked its end
            self.backward_end(self.owner[1])
        level = self._switch(("bwd", i))
        if self.tracker is not None and self.outside_inputs is None:
            self.tracker.watched.clear()  # forward is over: `Windows.read` holds what was read
            self.outside_inputs = tuple(  # those nothing kept for backward
                (nbytes, frozenset(users)) for key, (nbytes, ref, users) in self.inputs.items()
                if not self.tracker.is_live(key, ref)
            )
        if self.tracker is not None and self.early is None and self.details:
            self.early = _early_deaths(self.tracker, [d for j, (d, _) in self.details.items() if j != i])
        if self.tracker is not None and i in self.details:
            detail, out = self.details[i]
            live = frozenset(self.tracker.still_live(detail, [n for n, ref in out if ref() is not None]))
            alive = sum(detail.born[n] for n in self.tracker.still_live(detail, detail.refs))
            self.at_backward[i] = (level - (self.held_sum - self.held[i]), alive, live)
            if self.timing:
                self.clock = now()

    def gradient_made(self, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated: the first time in this step, a default loop would have made it
        here (NOTE [ Gradients in the budget ] in costs.py)."""
        if self.tracker is not None and id(param) not in self.made:
            self.made.add(id(param))
            self.tracker.made(param.numel() * param.element_size())

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


def _hooks(blocks: Sequence[nn.Module], marks: Marks) -> list[Any]:
    handles: list[Any] = []
    for i, block in enumerate(blocks):

        def pre(module: nn.Module, args: Any, kwargs: Any, i: int = i) -> None:
            if i in marks.describing:
                marks.specs[i] = describe_args(args, kwargs)
            marks.note_inputs(i, args, kwargs)
            marks.forward_start(i)
            first = _first_grad_tensor((args, kwargs))
            if first is not None and torch.is_grad_enabled():
                marks.on_grad(first, 0, i)

        def post(module: nn.Module, args: Any, kwargs: Any, output: Any = None, i: int = i) -> None:
            marks.forward_end(i, output)
            first = _first_grad_tensor(output)
            if first is not None:
                marks.on_grad(first, 1, i)

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True, always_call=True))
    return handles


def marked_step(
    step: Step,
    blocks: Sequence[nn.Module],
    tracked: bool,
    timing: bool,
    devices: tuple[torch.device, ...],
    describe: Collection[int] = (),
    detailed: Collection[int] = (),
    params: Sequence[torch.Tensor] = (),
) -> Marks:
    """One step with window marks: tracked for bytes, timed, or both (NOTE [ Timing under the tracker ]).

    The gradients of `params` count in the window where backward makes them (NOTE [ Gradients in the budget ]).
    """
    with contextlib.ExitStack() as stack:
        tracker: Windows | None = None
        if tracked:
            tracker = Windows()
            stack.enter_context(tracker)
            tracker.per_op = per_op_overhead() if timing else 0.0
        marks = Marks(len(blocks), tracker, timing, devices)
        marks.describing = set(describe)
        marks.detailed = set(detailed)
        handles = _hooks(blocks, marks)
        if tracker is not None:
            handles += [p.register_post_accumulate_grad_hook(marks.gradient_made)  # type: ignore[no-untyped-call]
                        for p in params]
        try:
            if timing:
                synchronize(devices)
                if tracker is not None:
                    tracker.take_overhead()
                marks.clock = now()
            torch.autograd.backward(step())
            marks.finish()
        finally:
            for handle in handles:
                handle.remove()
    return marks


# NOTE [ Timing under the tracker ]
# The tracker runs Python for every aten op, which a plain step does not. Rather than run each profiling round
# twice (once tracked for bytes, once bare for time), the tracked step keeps the clock too, and its times are
# corrected for the tracker.
#
# Rules:
# 1. The tracker's own time is taken out of every window: what its bookkeeping (`_see`, the release callbacks)
#    measurably took, plus, per op, the cost of entering the mode and calling back into the op, which no clock
#    inside the mode can see. The marks' own work between windows is kept out of every window.
# 2. What is left still runs slow on CPU (most in backward, more for blocks under remat: docs/benchmarks.md): the
#    tracked ops themselves run slower than bare ones, by more than small ops show. So after the rounds, one block
#    of the largest kind runs alone and untracked once per choice that ran, and scales the tracked times.
# 3. The ratio only refines the times: if the block cannot run alone (any exception), the tracked times stay as
#    they are.
# 4. This holds on CPU, where everything runs in the calling thread. Where a device runs asynchronously (CUDA), the
#    tracker's Python may hide under the kernels or not, so there each round runs a second, untracked step for the
#    clock, and no block runs alone.
#
# Implementation notes:
# 1. (rule 1) The per-op constant is calibrated once per process on a few hundred small ops (`per_op_overhead`).
# 2. (rule 2) profile.py runs the block once in all when only kept ran (the derived choices' times are made of
#    kept's, NOTE [ Deriving choices ] in costs_derived.py), on fresh inputs shaped like the ones it saw
#    (profile_alone.py); costs.py scales each choice's forward and backward times, for every kind, by the ratio of
#    that run to the tracked median (never up, never below half), and the outside time by the ratio over all
#    choices run. For a stack of identical layers this costs one block's forward and backward.


class Detail:
    """What one window saw, op by op, for deriving other choices from it (NOTE [ Deriving choices ] in
    costs_derived.py).

    Storages are numbered in the order the window allocated them (a storage key, its address, may be reused
    once it is freed).

    Attributes:
        born: bytes of every storage the window allocated, by number.
        matmul: the numbers among `born` that a matmul-class op made (`remat.policies.save_matmuls`'s ops).
        calls: for each of `matmul`, which matmul-class call made it (counted from 0 in the window's order).
        cached: the numbers among `born` that are autocast's cached casts of parameters: they live until the
            step's autocast region ends, whatever the block's choice (NOTE [ A step's own autocast region ] in
            remat/_measure/step_autocast.py).
        call_time: per matmul-class call, its seconds (from the end of the op before).
        changed: the numbers among `matmul` that a later op of the window wrote into (in place, through any view):
            a policy does not keep those (NOTE [ A kept output changed in place ] in remat/_engine/kept.py).
        events: `(number, bytes)` in order: + when a storage of `born` was allocated, - when it was released, 0
            when an op read it (noted after that op's outputs).
        ops: aten ops the window ran.
        live: the storages of `born` live now (while the window is open) or when it closed: key -> number.
        refs: when the window closed, the tracker's weak reference to each storage of `live`, by number.
    """

    __slots__ = ("born", "cached", "call_time", "calls", "changed", "events", "live", "matmul", "ops", "refs")

    def __init__(self) -> None:
        self.born: dict[int, int] = {}
        self.matmul: set[int] = set()
        self.cached: set[int] = set()
        self.calls: dict[int, int] = {}
        self.call_time: list[float] = []
        self.changed: set[int] = set()
        self.events: list[tuple[int, int]] = []
        self.ops = 0
        self.live: dict[int, int] = {}
        self.refs: dict[int, tuple[int, object]] = {}


class Windows(FakeTracker):
    """A tracker that keeps the peak since the last `mark` and its own time (NOTE [ Timing under the tracker ]);
    a fake twin's tensors count on the device they claim (NOTE [ Counting fake tensors ] in fake.py).

    While `detail` is set, it also records what the window allocates and releases, op by op (`Detail`).
    """

    window_peak = 0
    _made = 0  # bytes counted by `made` in the window open now
    overhead = 0.0  # seconds of this tracker's own work since the last `take_overhead`
    per_op = 0.0  # seconds per op that the clocks in `_see` cannot see
    detail: Detail | None = None
    _last = 0.0  # when the last `_see` ended: an op's time is from there to the start of the next one's
    _in_matmul = False
    _casting = False  # the op is autocast's cached cast of a parameter: `Detail.cached`
    in_block = False  # a block's forward window is open: what is allocated now is not in `outside_born`

    def __init__(self) -> None:
        super().__init__()
        self.outside_born: set[int] = set()  # live storages allocated while no block's forward ran
        self.watched: dict[int, tuple[int, int]] = {}  # storage key of a block's output -> (block, its number)
        self.read: set[tuple[int, int]] = set()  # those of `watched` an op read (`KeptRun.read_outputs`)

    def mark(self) -> int:
        """The window's peak; the next window starts at what is live now, gradients counted by `made` left out."""
        with self._lock:
            peak = self.window_peak
            self.current_bytes -= self._made
            self._made = 0
            self.window_peak = self.current_bytes
        self._last = now()
        return peak

    def made(self, nbytes: int) -> None:
        """Count `nbytes` of a gradient a default loop's backward would have made here, to the window's end
        (NOTE [ Gradients in the budget ] in costs.py). The peak moves with the next allocation: the gradient
        that was just added in place into a zero one is released right after this is called, and a real step
        keeps that very tensor as the gradient."""
        with self._lock:
            self.current_bytes += nbytes
            self._made += nbytes

    def take_overhead(self) -> float:
        overhead, self.overhead = self.overhead, 0.0
        return overhead

    def _see(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        start = now()
        detail = self.detail
        read = _storages_read(args, kwargs) if self.watched or detail is not None else ()
        if self.watched:
            self.read.update(found for key in read if (found := self.watched.get(key)) is not None)
        if detail is None:
            super()._see(func, args, kwargs, out)
        else:
            detail.ops += 1
            if detail.matmul and op_info(func).writes:
                _note_writes(detail, func, args, kwargs)
            self._casting = cached_cast(func, args, kwargs)
            if matmuls(func):
                detail.call_time.append(max(0.0, start - self._last - self.per_op))
                self._in_matmul = True
                try:
                    super()._see(func, args, kwargs, out)
                finally:
                    self._in_matmul = False
            else:
                super()._see(func, args, kwargs, out)
            detail.events.extend((number, 0) for key in read if (number := detail.live.get(key)) is not None)
        self._last = end = now()
        self.overhead += end - start + self.per_op

    def _add(self, key: int, t: torch.Tensor, st: torch.UntypedStorage) -> None:
        super()._add(key, t, st)
        if not self.in_block:
            self.outside_born.add(key)
        detail = self.detail
        if detail is not None:
            number = len(detail.born)
            nbytes = self._live[key][1]
            detail.live[key] = number
            detail.born[number] = nbytes
            detail.events.append((number, nbytes))
            if self._in_matmul:
                detail.matmul.add(number)
                detail.calls[number] = len(detail.call_time) - 1
            if self._casting:
                detail.cached.add(number)

    def _release(self, key: int, ref: object = None) -> None:
        start = now()
        self.outside_born.discard(key)
        detail = self.detail
        if detail is not None:
            number = detail.live.pop(key, None)
            if number is not None:
                detail.events.append((number, -detail.born[number]))
        super()._release(key, ref)
        self.overhead += now() - start

    def _account(self, device: torch.device, delta: int) -> None:
        super()._account(device, delta)
        if self.current_bytes > self.window_peak:
            self.window_peak = self.current_bytes

    def close(self) -> Detail | None:
        """Stop recording in detail; the detail recorded, with a weak reference to each storage still live."""
        detail, self.detail = self.detail, None
        if detail is not None:
            detail.refs = {number: (key, self._live[key][2]) for key, number in detail.live.items()}
        return detail

    def born_outside(self, key: int) -> tuple[int, object] | None:
        """The bytes and weak reference of the live storage `key` if no block's forward allocated it, else None."""
        entry = self._live.get(key)
        return (entry[1], entry[2]) if entry is not None and key in self.outside_born else None

    def is_live(self, key: int, ref: object) -> bool:
        """Whether the storage that `ref` (from `born_outside`) refers to is live still."""
        entry = self._live.get(key)
        return entry is not None and entry[2] is ref

    def still_live(self, detail: Detail, numbers: Iterable[int]) -> list[int]:
        """The storages among `numbers` (of `detail`, live when it closed) that are live still."""
        out = []
        for number in numbers:
            key, ref = detail.refs.get(number, (0, None))
            if self.is_live(key, ref):
                out.append(number)
        return out


def _storages_read(args: Any, kwargs: dict[str, Any] | None) -> list[int]:
    """The storage keys of the tensors an op (or a block) was given."""
    keys = []
    for t in tree_leaves((args, kwargs)):
        storage = _storage(t) if isinstance(t, torch.Tensor) else None
        if storage is not None:
            keys.append(storage._cdata)
    return keys


def _note_writes(detail: Detail, func: Any, args: Any, kwargs: dict[str, Any] | None) -> None:
    """Note the matmul-class outputs of `detail` that the op `func` writes into (`Detail.changed`)."""
    for position, name in op_info(func).writes:
        value = args[position] if position < len(args) else (kwargs or {}).get(name)
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            storage = _storage(tensor) if isinstance(tensor, torch.Tensor) else None
            number = detail.live.get(storage._cdata) if storage is not None else None
            if number is not None and number in detail.matmul:
                detail.changed.add(number)


def mode_cost(mode: Callable[[], Any], seen: Callable[[Any], float] = lambda mode: 0.0, ops: int = 128,
              tries: int = 3) -> float:
    """Seconds per small op that running under `mode()` adds, less what `seen(mode)` says its own clocks saw
    (the least over a few tries, never below zero). A wall-clock calibration: never on priced time."""
    x = torch.zeros(8)
    best = math.inf
    for _ in range(tries):
        start = time.perf_counter()
        for _ in range(ops):
            x.add(1)
        bare = time.perf_counter() - start
        with mode() as entered:
            start = time.perf_counter()
            for _ in range(ops):
                x.add(1)
            under = time.perf_counter() - start
        best = min(best, (under - bare - seen(entered)) / ops)
    return max(0.0, best)


def per_op_overhead() -> float:
    """Seconds per op that a tracker costs beyond what its own clocks measure (none on priced time: NOTE [ Priced
    time ] in clock.py)."""
    return 0.0 if priced() else _calibrated()


@functools.cache  # calibrated once per process: NOTE [ Timing under the tracker ]
def _calibrated() -> float:
    return mode_cost(Windows, lambda tracker: float(tracker.overhead))


def mode_overhead() -> float:
    """Seconds per op that `save_matmuls`' dispatch mode adds to a small op (a floor: NOTE [ Mode cost in
    place ]); on priced time, the nominal device's (NOTE [ Priced time ] in remat/_measure/clock.py)."""
    return MODE_PER_OP if priced() else _calibrated_mode()



@functools.cache  # calibrated once per process: NOTE [ Mode cost in place ] in costs_derived.py
def _calibrated_mode() -> float:
    return mode_cost(lambda: SaveOps(save_matmuls))
