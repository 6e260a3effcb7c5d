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
show. So after the rounds, profile.py runs one block of the largest kind alone and untracked once per choice,
on fresh inputs shaped like the ones it saw (alone.py), and scales each choice's forward and backward times,
for every kind, by the ratio of that run to the tracked median (never up, never below half), and the outside
time by the ratio over all choices. For a stack of identical layers this costs k blocks' forward and backward
(a third of a step for 12 blocks and 3 choices). If the block cannot run alone (any exception), the tracked
times stay as they are: the ratio only refines them.
This holds on CPU, where everything runs in the calling thread. Where a device runs asynchronously (CUDA), the
tracker's Python may hide under the kernels or not, so there each round runs a second, untracked step for the
clock, and no block runs alone.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from .track import Tracker

__all__ = ["Windows", "per_op_overhead"]


class Windows(Tracker):
    """A tracker that keeps the peak since the last `mark` and its own time (NOTE [ Timing under the tracker ])."""

    window_peak = 0
    overhead = 0.0  # seconds of this tracker's own work since the last `take_overhead`
    per_op = 0.0  # seconds per op that the clocks in `_see` cannot see

    def mark(self) -> int:
        peak, self.window_peak = self.window_peak, self.current_bytes
        return peak

    def take_overhead(self) -> float:
        overhead, self.overhead = self.overhead, 0.0
        return overhead

    def _see(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        start = time.perf_counter()
        super()._see(func, args, kwargs, out)
        self.overhead += time.perf_counter() - start + self.per_op

    def _release(self, key: int, ref: object = None) -> None:
        start = time.perf_counter()
        super()._release(key, ref)
        self.overhead += time.perf_counter() - start

    def _account(self, device: torch.device, delta: int) -> None:
        super()._account(device, delta)
        if self.current_bytes > self.window_peak:
            self.window_peak = self.current_bytes


_PER_OP: list[float] = []  # the calibrated constant of NOTE [ Timing under the tracker ], once per process


def per_op_overhead(ops: int = 128, tries: int = 3) -> float:
    """Seconds per op that a tracker costs beyond what its own clocks measure (the least over a few tries)."""
    if _PER_OP:
        return _PER_OP[0]
    x = torch.zeros(8)
    best = math.inf
    for _ in range(tries):
        start = time.perf_counter()
        for _ in range(ops):
            x.add(1)
        bare = time.perf_counter() - start
        tracker = Windows()
        with tracker:
            start = time.perf_counter()
            for _ in range(ops):
                x.add(1)
            tracked = time.perf_counter() - start
        best = min(best, (tracked - bare - tracker.overhead) / ops)
    _PER_OP.append(max(0.0, best))
    return _PER_OP[0]
