"""The whole-model front end of the solver: one rematerialization choice per block under a budget.

`remat.apply(model, budget=...)` (apply.py) profiles every block under every choice into a
`ModelCost` (NOTE [ Budget model ] in costs.py); this module evaluates a choice per block
(`evaluate_blocks`), finds the least budget that some choice fits (`least_budget_blocks`) and the fastest
choice under a budget (`solve_blocks`). The chain front end, `remat._chain.solver`, shares its
discretisation rule (NOTE [ Discretisation ]) and its `check_bytes`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._chain.simulate import check_bytes
from .._core.errors import BUG, RematError
from .costs import ModelCost

__all__ = ["evaluate_blocks", "least_budget_blocks", "solve_blocks"]

_INF = math.inf


def evaluate_blocks(cost: ModelCost, choice: Sequence[int]) -> tuple[int, float]:
    """The predicted peak bytes and step time of one choice per block (NOTE [ Budget model ])."""
    held, peak, time = 0, 0, cost.outside_time
    for i, (row, c) in enumerate(zip(cost.blocks, choice, strict=True)):
        block = row[c]
        if block is None:
            raise ValueError(f"remat: choice {cost.choices[c]!r} is not open to block {cost.names[i]!r}.")
        peak = max(peak, held + cost.outside_peaks[i], held + block.need)
        held += block.held_bytes
        time += block.time
    return max(peak, held + cost.outside_peaks[-1]), time


# NOTE [ Block recurrence ]
# `remat.apply(model, budget=...)` asks for one choice c_i per block under the model of NOTE [ Budget model ]
# (costs.py): with S_i the bytes held by blocks 0..i-1, a plan fits M when S_i + need(i, c_i)
# <= M for every block and S_k + outside_peaks[k] <= M for every k; its time is the sum of the blocks' times.
# The only state that links block i to the ones after it is S_i, so the dynamic program runs over blocks,
# keeping for every reachable S the least time (and dropping any (S, time) that another beats on both): the
# Pareto front of (bytes held, time). That is exact in bytes. Fronts stay small on real models (repeated
# blocks make repeated sums); if one grows past `slots` states, its S are rounded UP to multiples of
# M / slots before merging, as the chain solver's slots are (NOTE [ Discretisation ]): a plan that fits with
# rounded sums fits in bytes, and the solution is then at worst slightly slower, never over budget.
# The smallest feasible budget is exact too: for a given M, keeping the smallest reachable S is enough
# (every constraint only gets harder as S grows), so feasibility is a greedy pass, and the smallest M is
# found by bisection over integers.


def _fits_greedy(cost: ModelCost, budget: int) -> list[int] | None:
    held, choice = 0, []
    for i, row in enumerate(cost.blocks):
        if held + cost.outside_peaks[i] > budget:
            return None
        open_ = [(b.held_bytes, b.time, c) for c, b in enumerate(row) if b is not None and held + b.need <= budget]
        if not open_:
            return None
        h, _, c = min(open_)
        held += h
        choice.append(c)
    return choice if held + cost.outside_peaks[-1] <= budget else None


def least_budget_blocks(cost: ModelCost) -> tuple[int, tuple[int, ...]]:
    """The smallest budget under which some choice per block fits, in bytes, and such a choice."""
    low, high = 0, 1 + max(cost.outside_peaks) + sum(
        max(b.held_bytes for b in row if b is not None) + max(b.need for b in row if b is not None)
        for row in cost.blocks
    )
    while low < high:  # the smallest M with a feasible plan; feasibility is monotone in M
        mid = (low + high) // 2
        if _fits_greedy(cost, mid) is None:
            low = mid + 1
        else:
            high = mid
    found = _fits_greedy(cost, low)
    if found is None:  # pragma: no cover
        raise RematError(f"remat: the budget bisection found no plan; {BUG}.")
    return low, tuple(found)


def solve_blocks(cost: ModelCost, budget: int, *, slots: int = 4096) -> tuple[tuple[int, ...], float] | None:
    """The fastest choice per block that fits `budget` (NOTE [ Block recurrence ]), or None if none is found."""
    check_bytes("budget", budget)
    grain = max(1, -(-budget // slots))
    # The front: S -> (time, index of the back pointer); back pointers are (parent, choice) per block.
    front: dict[int, tuple[float, int]] = {0: (0.0, -1)}
    parents: list[list[tuple[int, int]]] = []
    for i, row in enumerate(cost.blocks):
        out: dict[int, tuple[float, int]] = {}
        links: list[tuple[int, int]] = []
        for held, (time, ptr) in front.items():
            if held + cost.outside_peaks[i] > budget:
                continue
            for c, block in enumerate(row):
                if block is None or held + block.need > budget:
                    continue
                new, t = held + block.held_bytes, time + block.time
                if new not in out or t < out[new][0]:
                    links.append((ptr, c))
                    out[new] = (t, len(links) - 1)
        front = _pareto(out)
        if len(front) > slots:
            coarse: dict[int, tuple[float, int]] = {}
            for held, entry in front.items():
                key = -(-held // grain) * grain
                if key not in coarse or entry[0] < coarse[key][0]:
                    coarse[key] = entry
            front = _pareto(coarse)
        parents.append(links)
        if not front:
            return None
    ends = [(time, ptr) for held, (time, ptr) in front.items() if held + cost.outside_peaks[-1] <= budget]
    if not ends:
        return None
    time, ptr = min(ends)
    choice: list[int] = []
    for links in reversed(parents):
        ptr, c = links[ptr]
        choice.append(c)
    return tuple(reversed(choice)), cost.outside_time + time


def _pareto(states: dict[int, tuple[float, int]]) -> dict[int, tuple[float, int]]:
    """Keep the states that no state with fewer bytes held beats on time."""
    kept: dict[int, tuple[float, int]] = {}
    best = _INF
    for held in sorted(states):
        entry = states[held]
        if entry[0] < best:
            kept[held] = entry
            best = entry[0]
    return kept
