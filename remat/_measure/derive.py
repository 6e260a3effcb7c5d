"""Derive what a block costs under full remat and under `save_matmuls` from one tracked run of it kept.

NOTE [ Deriving choices ]
Running every choice for real takes tracked rounds: a kind of block with one member needs one round per choice,
each slower than a plain step. But what a rematerialized block does is a replay of what it does kept, and the
tracker sees every op of that: so one tracked run of a block kept (`Kept`, filled by profile.py from the
window's `Detail` in windows.py) gives its other choices, in the terms of NOTE [ Budget model ] in costs.py.
Under choice c (full remat, or `save_matmuls`), with "born" the storages its forward allocated:
* Held bytes: the born storages of its outputs (what the next block reads), plus, for `save_matmuls`, every
  storage a matmul-class op made (the policy keeps them all until recompute; NOTE [ What a policy keeps ]).
  Its inputs are held by whoever made them, whatever this block does.
* Forward peak: the forward's allocation log replayed, with what kept's autograd saves and c does not hold
  (storages born and never released in the window, outputs and c's matmul outputs aside) released as the next
  storage is allocated, as an operand dies after the op that reads it; and under `save_matmuls` with the
  matmul outputs never released. Exact on the benchmark's convnet; it misses what the block's Python holds
  longer (on the GPT-like stack's blocks about a fifth of their forward peak under full remat), which matters
  only where the forward is a block's larger peak, and there backward's recompute peaks higher anyway.
* Backward peak: backward starts at what kept started at (`at_backward`, above S_i), less the born storages
  kept still held then, plus those that c holds (`alive_out`, and the matmul outputs). Recompute then replays
  the forward's allocation log on top (a matmul output under `save_matmuls` is handed back, not allocated
  again); after it, what recompute built that backward does not need is gone as it was in kept's run, and
  backward runs as kept's did. The peak is the larger of the two phases.
* Times: the forward is kept's; the backward is kept's plus a recompute, which is kept's forward less its
  matmul-class ops under `save_matmuls` (each op's time is measured from the end of the op before, so the
  Python between ops counts in the non-matmul part). `save_matmuls` runs a dispatch mode over every op in
  forward and in recompute: `ops` times its cost per op (`mode_overhead`, calibrated once per process).
The forward peak is an upper bound and the rest a model; tests/test_budget_derive.py checks derived against
measured costs on small models, and the benchmark prints predicted against measured peaks and times.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .._engine.selective import SaveOps
from .._policies import save_matmuls
from .windows import Detail

__all__ = ["DERIVABLE", "Kept", "derive_bytes", "derive_times", "mode_overhead"]

DERIVABLE = ("full", "save_matmuls")


@dataclass(frozen=True)
class Kept:
    """One block's tracked run kept: the numbers a derivation starts from (bytes above S_i: NOTE [ Budget model ]).

    Args:
        base: bytes live at its forward start.
        held: bytes its forward left alive.
        forward_peak: the peak while its forward ran.
        backward_peak: the peak while its backward ran.
        at_backward: bytes live when its backward started.
        alive: bytes of its born storages still live when its backward started.
        out_keys: its outputs' born storages.
        live_out: those of them still live when its backward started.
        detail: its forward window's allocations, op by op.
    """

    base: int
    held: int
    forward_peak: int
    backward_peak: int
    at_backward: int
    alive: int
    out_keys: frozenset[int]
    live_out: frozenset[int]
    detail: Detail


def _replay(detail: Detail, handed: bool, keep: bool, drop: frozenset[int] | None = None) -> int:
    """The peak of the forward's allocation log, from 0 (see NOTE [ Deriving choices ]).

    handed: matmul outputs are not allocated (recompute under save_matmuls gets them back).
    keep: matmul outputs are never released (forward under save_matmuls keeps them).
    drop: storages never released in the log that die once the next storage is allocated (rerun's forward).
    """
    level = peak = 0
    matmul = detail.matmul
    pending = 0
    for number, delta in detail.events:
        if number in matmul and ((handed and delta > 0) or (keep and delta < 0)):
            continue
        level += delta
        peak = max(peak, level)
        if delta > 0:
            level -= pending
            pending = detail.born[number] if drop is not None and number in drop else 0
    return peak


def derive_bytes(choice: str, kept: Kept) -> tuple[int, int, int]:
    """Held bytes, forward peak and backward peak (above S_i) of a block under `choice`, from its run kept.

    >>> d = Detail()
    >>> d.born, d.matmul, d.events = {1: 8, 2: 4}, {1}, [(1, 8), (2, 4)]  # a matmul output, then the output
    >>> kept = Kept(0, 12, 12, 20, 16, 12, frozenset({2}), frozenset({2}), d)
    >>> derive_bytes("full", kept), derive_bytes("save_matmuls", kept)
    ((4, 12, 20), (12, 12, 20))
    """
    detail = kept.detail
    born = detail.born
    if choice == "full":
        holds = kept.out_keys
    elif choice == "save_matmuls":
        holds = kept.out_keys | detail.matmul
    else:
        raise ValueError(f"remat: cannot derive choice {choice!r}; derivable: {', '.join(DERIVABLE)}.")
    handed = choice == "save_matmuls"
    held = sum(born[key] for key in holds)
    released = {number for number, delta in detail.events if delta < 0}
    dropped = frozenset(n for n in born if n not in released and n not in holds)  # what kept saves, rerun drops
    forward_peak = kept.base + _replay(detail, handed=False, keep=handed, drop=dropped)
    live = kept.live_out | detail.matmul if handed else kept.live_out  # born storages live at backward under c
    start = kept.at_backward - kept.alive + sum(born[key] for key in live)
    rise = _replay(detail, handed=handed, keep=False)
    backward_peak = max(start + rise, kept.backward_peak)
    return held, forward_peak, backward_peak


def derive_times(
    choice: str, forward: float, backward: float, matmul: float, ops: float, per_op: float
) -> tuple[float, float]:
    """Forward and backward seconds of a block under `choice`, from its times kept (NOTE [ Deriving choices ]).

    >>> derive_times("full", 1.0, 2.0, 0.5, 10, 0.01), derive_times("save_matmuls", 1.0, 2.0, 0.5, 10, 0.01)
    ((1.0, 3.0), (1.1, 2.6))
    """
    if choice == "full":
        return forward, backward + forward
    if choice == "save_matmuls":
        mode = ops * per_op
        return forward + mode, backward + max(0.0, forward - matmul) + mode
    raise ValueError(f"remat: cannot derive choice {choice!r}; derivable: {', '.join(DERIVABLE)}.")


_MODE: list[float] = []  # seconds per op of `save_matmuls`' dispatch mode, once per process


def mode_overhead(ops: int = 128, tries: int = 3) -> float:
    """Seconds per op that `save_matmuls`' dispatch mode adds to a small op (the least over a few tries)."""
    if _MODE:
        return _MODE[0]
    x = torch.zeros(8)
    best = math.inf
    for _ in range(tries):
        start = time.perf_counter()
        for _ in range(ops):
            x.add(1)
        bare = time.perf_counter() - start
        with SaveOps(save_matmuls):
            start = time.perf_counter()
            for _ in range(ops):
                x.add(1)
            moded = time.perf_counter() - start
        best = min(best, (moded - bare) / ops)
    _MODE.append(max(0.0, best))
    return _MODE[0]
