"""Stage 3, solve: one rematerialization choice per block so that the predicted peak fits a budget at the least
predicted time (NOTE [ Block recurrence ]), read from a `ModelCost` (costs.py).

Nothing here touches a tensor, so costs measured on fake tensors plan the same way:

>>> from remat._budget.costs import BlockCost, ModelCost
>>> kept, full = BlockCost(8, 12, 16, 1.0, 2.0), BlockCost(1, 12, 20, 1.0, 3.0)
>>> cost = ModelCost(("0", "1"), ("kept", "full"), ((kept, full), (kept, full)), (0, 0, 4), 0.5)
>>> assignment = solve_budget(cost, 22)
>>> [assignment.choices[c] for c in assignment.choice], assignment.peak_bytes, assignment.step_time
(['full', 'kept'], 20, 7.5)

The chain front end, `remat._chain.solver`, shares this solver's discretisation rule (NOTE [ Discretisation ]) and
its `check_bytes`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .._chain.simulate import check_bytes
from .._core.errors import BUG, BudgetError, RematError
from .._core.units import STEP_PEAK, format_bytes
from .costs import KEPT, BlockCost, ModelCost

__all__ = [
    "Assignment", "evaluate_blocks", "least_assignment", "least_budget_blocks", "resolve_budget", "solve_blocks",
    "solve_budget",
]


@dataclass(frozen=True)
class Assignment:
    """One choice assigned to each block under a budget, with its predicted step peak and the two uniform
    baselines' (what `remat.plan(model).budget` shows).

    Every byte count is a step peak: the most bytes live during a training step's forward and backward above what
    was live when it began, the gradients backward allocates included (what a budget bounds, and what
    `remat.track()` around the step reads).

    Attributes:
        cost: the costs it was solved on.
        choice: the index into `cost.choices` chosen for each block.
        budget: the budget in bytes.
        peak_bytes, step_time: its predicted step peak (bytes) and step time (seconds).
        no_remat, full_remat: `(peak_bytes, step_time)` of every block kept, and of every block fully
            rematerialized (None when a choice is missing from the profile).
        measured: the step peak of one real training step with these choices, tracked (None until one ran: NOTE
            [ Verifying the plan ] in verify.py).
        missed: bytes a measured step of an earlier assignment held beyond its prediction, which `peak_bytes`
            includes (0 unless it corrects one that went over its budget).
    """

    cost: ModelCost
    choice: tuple[int, ...]
    budget: int
    peak_bytes: int
    step_time: float
    no_remat: tuple[int, float] | None
    full_remat: tuple[int, float] | None
    measured: int | None = None
    missed: int = 0

    @property
    def choices(self) -> tuple[str, ...]:
        """The labels of the choices, indexed by `choice`."""
        return self.cost.choices

    def block(self, i: int) -> tuple[str, str, BlockCost, float]:
        """Block i's name, choice, cost, and extra time over keeping it (0 when it cannot be kept)."""
        row = self.cost.blocks[i]
        chosen = row[self.choice[i]]
        assert chosen is not None
        kept = row[0] if self.cost.choices[0] == KEPT else None
        extra = chosen.time - kept.time if kept is not None else 0.0
        return self.cost.names[i], self.cost.choices[self.choice[i]], chosen, extra

    def time(self, seconds: float, extra: bool = False) -> str:
        """A predicted time as `remat.plan(model)` says it: milliseconds where they were measured on this device;
        where the profile priced ops on a nominal device (fake tensors: NOTE [ Priced time ]), relative to the step
        without remat, which is all those prices can say."""
        base = self.no_remat[1] if self.no_remat is not None else None
        if not self.cost.priced or not base:
            return f"{seconds * 1e3:+.2f} ms" if extra else f"{seconds * 1e3:.1f} ms"
        if extra:
            return f"{seconds / base:+.1%}"
        return f"{seconds / base:.2f}x no remat's"

    def summary(self, carrying: str = "") -> list[str]:
        """Its figures as lines: predicted step peak and step time, and the two baselines'. `carrying` names what
        the model carried while it was planned (the head in chunks, tiles), which the baselines carry too."""
        lines = [
            f"predicted step peak {format_bytes(self.peak_bytes)} (budget {format_bytes(self.budget)}), "
            f"step time {self.time(self.step_time)}"
        ]
        if self.measured is not None:
            lines.append(f"measured on one real step: step peak {format_bytes(self.measured)} "
                         f"({self.measured / self.budget:.2f} of the budget)")
        else:
            lines.append("not measured yet: the model's first training step verifies this plan")
        if self.missed:
            lines.append(f"re-planned after a measured step went over the budget: the prediction counts "
                         f"{format_bytes(self.missed)} it had missed")
        with_ = f" (with {carrying})" if carrying else ""
        for label, figures in (("no remat", self.no_remat), ("full remat", self.full_remat)):
            if figures is not None:
                lines.append(f"{label}{with_}: step peak {format_bytes(figures[0])}, step time "
                             f"{self.time(figures[1])}")
        lines.append(f"step peak: {STEP_PEAK}")
        if self.cost.priced:
            lines.append(f"times are relative to no remat's step{with_}: planned on fake tensors, ops priced on a "
                         "nominal device rather than timed on this one")
        return lines


def _uniform(cost: ModelCost, label: str) -> tuple[int, float] | None:
    if label not in cost.choices:
        return None
    c = cost.choices.index(label)
    if any(row[c] is None for row in cost.blocks):
        return None
    return evaluate_blocks(cost, [c] * len(cost))


def resolve_budget(budget: int | float, cost: ModelCost) -> int:
    """Bytes for `budget` (parsed: `parse_budget`): as given, or a fraction of the predicted step peak of keeping
    every block (no remat's).

    Raises:
        ValueError: a fraction was given but the costs have no "kept" choice for every block.
    """
    if isinstance(budget, int):
        return budget
    base = _uniform(cost, "kept")
    if base is None:
        raise ValueError(
            "remat: a fractional budget is a fraction of no remat's step peak, which this profile lacks (no 'kept' "
            "choice for every block); give the budget in bytes instead."
        )
    return max(1, math.floor(budget * base[0]))


def solve_budget(cost: ModelCost, budget: int | float, *, slots: int = 4096) -> Assignment:
    """Choose one option per block so that the predicted peak fits `budget` at the least predicted time.

    Args:
        cost: the blocks' costs (NOTE [ Budget model ] in costs.py).
        budget: bytes (an int), or a float in (0, 1]: that fraction of the predicted step peak with every block
            kept (`parse_budget` turns what a user writes into one of these).
        slots: the largest Pareto front kept per block before sizes are rounded (NOTE [ Block recurrence ]).

    Returns:
        The `Assignment`; its predicted step peak, `peak_bytes`, is at most the budget.

    Raises:
        BudgetError: no choice per block fits; the message names the smallest budget that does.
    """
    nbytes = resolve_budget(budget, cost)
    least, least_choice = least_budget_blocks(cost)
    if nbytes < least:
        asked = f"{budget!r} = {nbytes} bytes" if not isinstance(budget, int) else f"{nbytes} bytes"
        raise BudgetError(
            f"remat: no choice per block of these {len(cost)} blocks fits a budget of {asked} "
            f"({format_bytes(nbytes)}) under the profile; the smallest feasible budget is {least} bytes "
            f"({format_bytes(least)}). Raise the budget to at least that, or add choices that keep less.",
            least_bytes=least,
        )
    found = solve_blocks(cost, nbytes, slots=slots)
    candidates = [found[0]] if found is not None else []
    candidates.append(least_choice)
    for c in range(len(cost.choices)):
        if all(row[c] is not None for row in cost.blocks):
            candidates.append(tuple([c] * len(cost)))
    scored = [(evaluate_blocks(cost, ch), ch) for ch in candidates]
    fits = [(time, peak, ch) for (peak, time), ch in scored if peak <= nbytes]
    time, peak, choice = min(fits, key=lambda item: item[0])  # min keeps the first of equals: the DP's
    return Assignment(cost, tuple(choice), nbytes, peak, time, _uniform(cost, "kept"), _uniform(cost, "full"))


def least_assignment(cost: ModelCost, budget: int | float) -> Assignment:
    """The choice per block with the least predicted peak, under `budget` (which it may not fit)."""
    choice = least_budget_blocks(cost)[1]
    peak, time = evaluate_blocks(cost, choice)
    return Assignment(cost, choice, resolve_budget(budget, cost), peak, time, _uniform(cost, "kept"),
                      _uniform(cost, "full"))


# -- the dynamic program over blocks -------------------------------------------------------------------------------

_INF = math.inf


class _Steps:
    """One step of the block recurrence (NOTE [ Block recurrence ]) over `cost`: the groups of outside inputs
    (NOTE [ Outside inputs ] in costs.py) as bit masks, which each block holds under each choice, and the bytes of
    each set held."""

    def __init__(self, cost: ModelCost) -> None:
        self.cost = cost
        inputs = cost.outside_inputs
        self.takes = [sum(1 << k for k, group in enumerate(inputs) if i in group.users) for i in range(len(cost))]
        self.holds = [label != KEPT for label in cost.choices]
        self.bytes = [sum(group.nbytes for k, group in enumerate(inputs) if mask >> k & 1)
                      for mask in range(1 << len(inputs))]

    def after(self, i: int, c: int, groups: int) -> int:
        """The groups held once block i ran its forward under choice c, `groups` before it."""
        return groups | self.takes[i] if self.holds[c] else groups

    def moves(self, i: int, groups: int, held: int, budget: int) -> Iterator[tuple[int, BlockCost, int]]:
        """The choices c open to block i that fit `budget` where the blocks before it hold `held` bytes and `groups`
        (the window before it included), each with its cost and the groups held after it."""
        if held + self.cost.outside_peaks[i] + self.bytes[groups] > budget:
            return
        for c, block in enumerate(self.cost.blocks[i]):
            if block is None:
                continue
            after = self.after(i, c, groups)
            if held + max(block.forward_peak, block.backward_peak + self.bytes[after]) <= budget:
                yield c, block, after

    def ends(self, groups: int, held: int, budget: int) -> bool:
        """Whether the window after the last forward (the loss, its backward) fits `budget`."""
        return held + self.cost.outside_peaks[-1] + self.bytes[groups] <= budget


def evaluate_blocks(cost: ModelCost, choice: Sequence[int]) -> tuple[int, float]:
    """The predicted peak bytes and step time of one choice per block (NOTE [ Budget model ] and NOTE [ Outside
    inputs ] in costs.py)."""
    steps = _Steps(cost)
    held, groups, peak, time = 0, 0, 0, cost.outside_time
    for i, (row, c) in enumerate(zip(cost.blocks, choice, strict=True)):
        block = row[c]
        if block is None:
            raise ValueError(f"remat: choice {cost.choices[c]!r} is not open to block {cost.names[i]!r}.")
        peak = max(peak, held + cost.outside_peaks[i] + steps.bytes[groups])
        groups = steps.after(i, c, groups)
        peak = max(peak, held + block.forward_peak, held + block.backward_peak + steps.bytes[groups])
        held += block.held_bytes
        time += block.time
    return max(peak, held + cost.outside_peaks[-1] + steps.bytes[groups]), time


# NOTE [ Block recurrence ]
# `remat.apply(model, budget=...)` asks for one choice c_i per block under the model of NOTE [ Budget model ]
# in costs.py: with S_i the bytes held by blocks 0..i-1, a plan fits M when S_i + need(i, c_i)
# <= M for every block and S_k + outside_peaks[k] <= M for every k; its time is the sum of the blocks' times.
# The only state that links block i to the ones after it is S_i, with G_i, the groups of outside inputs that the
# blocks 0..i-1 hold (NOTE [ Outside inputs ] in costs.py: their bytes add to the backward peaks and the outside
# windows from there on; at most 2^4 sets, one where there are none), so the dynamic program runs over blocks,
# keeping for every reachable (G, S) the least time (and dropping any (S, time) that another of the same G beats
# on both): a Pareto front of (bytes held, time) per G. That is exact in bytes. Fronts stay small on real models
# (repeated blocks make repeated sums); if one grows past `slots` states, its S are rounded UP to multiples of
# M / slots before merging, as the chain solver's slots are (NOTE [ Discretisation ]): a plan that fits with
# rounded sums fits in bytes, and the solution is then at worst slightly slower, never over budget.
# The smallest feasible budget is exact too: for a given M and G, keeping the smallest reachable S is enough
# (every constraint only gets harder as S grows), so feasibility is a greedy pass over the sets G, and the
# smallest M is found by bisection over integers.


def _fits_greedy(cost: ModelCost, budget: int) -> list[int] | None:
    steps = _Steps(cost)
    front: dict[int, tuple[int, float, list[int]]] = {0: (0, 0.0, [])}  # G -> least S, its time, its choices
    for i in range(len(cost)):
        out: dict[int, tuple[int, float, list[int]]] = {}
        for groups, (held, time, choice) in front.items():
            for c, b, after in steps.moves(i, groups, held, budget):
                entry = (held + b.held_bytes, time + b.time, [*choice, c])
                if after not in out or entry[:2] < out[after][:2]:
                    out[after] = entry
        if not out:
            return None
        front = out
    ends = [(held, time, choice) for groups, (held, time, choice) in front.items()
            if steps.ends(groups, held, budget)]
    return min(ends, key=lambda end: end[:2])[2] if ends else None


def least_budget_blocks(cost: ModelCost) -> tuple[int, tuple[int, ...]]:
    """The smallest budget under which some choice per block fits, in bytes, and such a choice."""
    low, high = 0, 1 + max(cost.outside_peaks) + sum(found.nbytes for found in cost.outside_inputs) + sum(
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
    steps = _Steps(cost)
    grain = max(1, -(-budget // slots))
    # The fronts: G -> S -> (time, index of the back pointer); back pointers are (parent, choice) per block.
    fronts: dict[int, dict[int, tuple[float, int]]] = {0: {0: (0.0, -1)}}
    parents: list[list[tuple[int, int]]] = []
    for i in range(len(cost)):
        out: defaultdict[int, dict[int, tuple[float, int]]] = defaultdict(dict)
        links: list[tuple[int, int]] = []
        for groups, front in fronts.items():
            for held, (time, ptr) in front.items():
                for c, block, after in steps.moves(i, groups, held, budget):
                    states, new, t = out[after], held + block.held_bytes, time + block.time
                    if new not in states or t < states[new][0]:
                        links.append((ptr, c))
                        states[new] = (t, len(links) - 1)
        fronts = {groups: _coarse(_pareto(states), slots, grain) for groups, states in out.items()}
        parents.append(links)
        if not fronts:
            return None
    ends = [(time, ptr) for groups, front in fronts.items() for held, (time, ptr) in front.items()
            if steps.ends(groups, held, budget)]
    if not ends:
        return None
    time, ptr = min(ends)
    choice: list[int] = []
    for links in reversed(parents):
        ptr, c = links[ptr]
        choice.append(c)
    return tuple(reversed(choice)), cost.outside_time + time


def _coarse(front: dict[int, tuple[float, int]], slots: int, grain: int) -> dict[int, tuple[float, int]]:
    """`front` with its S rounded up to multiples of `grain` where it has more than `slots` states."""
    if len(front) <= slots:
        return front
    coarse: dict[int, tuple[float, int]] = {}
    for held, entry in front.items():
        key = -(-held // grain) * grain
        if key not in coarse or entry[0] < coarse[key][0]:
            coarse[key] = entry
    return _pareto(coarse)


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
