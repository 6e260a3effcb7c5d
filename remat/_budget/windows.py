"""A tracker that also marks windows and keeps its own time: what profile.py runs one step under.

NOTE [ Timing under the tracker ]
The tracker runs Python for every aten op, which a plain step does not. Rather than run each profiling round
twice (once tracked for bytes, once bare for time), the tracked step keeps the clock too and takes the
tracker's own time out of every window: what its bookkeeping (`_see`, the release callbacks) measurably took,
plus, per op, the cost of entering the mode and calling back into the op, which no clock inside the mode can
see; that constant is calibrated once per process on a few hundred small ops, in about 50 ms
(`per_op_overhead`). The recorder's own work between windows is kept out of every window.
What is left still runs slow, by 5-20% on CPU (measured on the benchmark's GPT-like stack; most in backward,
more for blocks under remat): the tracked ops themselves run slower than bare ones, by more than small ops
show. So after the rounds, profile.py runs one block of the largest kind alone and untracked once per choice
that ran (once in all when only kept ran: the derived choices' times are made of kept's, NOTE [ Deriving
choices ] in derive.py), on fresh inputs shaped like the ones it saw (alone.py), and scales each choice's
forward and backward times, for every kind, by the ratio of that run to the tracked median (never up, never
below half), and the outside time by the ratio over all choices run. For a stack of identical layers this
costs one block's forward and backward (a twelfth of a step for 12 blocks). If the block cannot run alone
(any exception), the tracked times stay as they are: the ratio only refines them.
This holds on CPU, where everything runs in the calling thread. Where a device runs asynchronously (CUDA), the
tracker's Python may hide under the kernels or not, so there each round runs a second, untracked step for the
clock, and no block runs alone.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._core.policies import matmuls
from .._measure.clock import now, priced
from .._measure.track import Tracker

__all__ = ["Detail", "Windows", "mode_cost", "per_op_overhead"]


class Detail:
    """What one window saw, op by op, for deriving other choices from it (NOTE [ Deriving choices ] in derive.py).

    Storages are numbered in the order the window allocated them (a storage key, its address, may be reused
    once it is freed).

    Attributes:
        born: bytes of every storage the window allocated, by number.
        matmul: the numbers among `born` that a matmul-class op made (`remat.policies.save_matmuls`'s ops).
        calls: for each of `matmul`, which matmul-class call made it (counted from 0 in the window's order).
        call_time: per matmul-class call, its seconds (from the end of the op before).
        events: `(number, bytes)` in order: + when a storage of `born` was allocated, - when it was released.
        ops: aten ops the window ran.
        live: the storages of `born` live now (while the window is open) or when it closed: key -> number.
        refs: when the window closed, the tracker's weak reference to each storage of `live`, by number.
    """

    __slots__ = ("born", "call_time", "calls", "events", "live", "matmul", "ops", "refs")

    def __init__(self) -> None:
        self.born: dict[int, int] = {}
        self.matmul: set[int] = set()
        self.calls: dict[int, int] = {}
        self.call_time: list[float] = []
        self.events: list[tuple[int, int]] = []
        self.ops = 0
        self.live: dict[int, int] = {}
        self.refs: dict[int, tuple[int, object]] = {}


class Windows(Tracker):
    """A tracker that keeps the peak since the last `mark` and its own time (NOTE [ Timing under the tracker ]).

    While `detail` is set, it also records what the window allocates and releases, op by op (`Detail`).
    """

    window_peak = 0
    overhead = 0.0  # seconds of this tracker's own work since the last `take_overhead`
    per_op = 0.0  # seconds per op that the clocks in `_see` cannot see
    detail: Detail | None = None
    _last = 0.0  # when the last `_see` ended: an op's time is from there to the start of the next one's
    _in_matmul = False

    def mark(self) -> int:
        peak, self.window_peak = self.window_peak, self.current_bytes
        self._last = now()
        return peak

    def take_overhead(self) -> float:
        overhead, self.overhead = self.overhead, 0.0
        return overhead

    def _see(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        start = now()
        detail = self.detail
        if detail is None:
            super()._see(func, args, kwargs, out)
        else:
            detail.ops += 1
            if matmuls(func):
                detail.call_time.append(max(0.0, start - self._last - self.per_op))
                self._in_matmul = True
                try:
                    super()._see(func, args, kwargs, out)
                finally:
                    self._in_matmul = False
            else:
                super()._see(func, args, kwargs, out)
        self._last = end = now()
        self.overhead += end - start + self.per_op

    def _add(self, key: int, t: torch.Tensor, st: torch.UntypedStorage) -> None:
        super()._add(key, t, st)
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

    def _release(self, key: int, ref: object = None) -> None:
        start = now()
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

    def still_live(self, detail: Detail, numbers: Iterable[int]) -> list[int]:
        """The storages among `numbers` (of `detail`, live when it closed) that are live still."""
        out = []
        for number in numbers:
            key, ref = detail.refs.get(number, (0, None))
            entry = self._live.get(key)
            if entry is not None and entry[2] is ref:
                out.append(number)
        return out


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
