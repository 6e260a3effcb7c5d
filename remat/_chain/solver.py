"""The rotor-style solver: the fastest schedule of a chain of stages under a memory budget.

The solver works on paper, without tensors: each stage is described by a `StageCost` (its forward and
backward times, the bytes of its output and of everything it keeps for backward), `solve` finds the
fastest schedule that fits a budget, and a `Schedule` lists the operations with the time and peak memory
that the model predicts. `remat.chain` profiles real modules into `StageCost`s and runs the `Schedule`.

The model is rotor's persistent model (Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova, "Optimal
checkpointing for heterogeneous chains", arXiv 1911.13214); see NOTE [ Memory model ] for the exact
accounting and NOTE [ Rotor recurrence ] for the dynamic program.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import torch

from .._core.errors import BUG, BudgetError, RematError
from .._core.public import claim
from .._core.units import format_bytes
from .schedule import Schedule
from .simulate import OpKind, StageCost, _InvalidOp, _Machine, check_bytes, check_stages

__all__ = ["OpKind", "Schedule", "StageCost", "smallest_budget", "solve"]
__all__ += ["_InvalidOp", "_Machine"]  # for the tests, which play schedules by hand

_INF = math.inf


# NOTE [ Rotor recurrence ]
# C(m, a, b) is the least time to back-propagate stages a..b (b = L is the loss) given that a_a is
# held outside m, that delta_{b+1} is held inside m, and that at most m bytes more may be live (the
# NOTE [ Memory model ] accounting; x_{L+1} = xbar_{L+1} = 0, u_f[L] = u_b[L] = 0).
#   a = b = L:  C = 0                                   if m >= x_L                       (loss)
#   a = b < L:  C = u_f[a] + u_b[a]                     if m >= x_{a+1} + xbar_{a+1} + ftmp_a
#                                                       and m >= x_{a+1} + xbar_{a+1} + x_a + btmp_a
#   a < b:      C = min of
#     (save)    u_f[a] + C(m - xbar_{a+1}, a+1, b) + u_b[a]
#                   if m >= x_{b+1} + xbar_{a+1} + ftmp_a and m >= xbar_{a+1} + x_{a+1} + x_a + btmp_a
#               ops: forward_save(a), <a+1..b>, backward(a)
#     (split j) for j in a+1..b: sum_{k=a}^{j-1} u_f[k] + C(m - x_j, j, b) + C(m, a, j-1)
#                   if m >= x_{b+1} + max(x_{a+1} + ftmp_a, max_{a<k<j} x_k + x_{k+1} + ftmp_k)
#               ops: forward_checkpoint(a), forward_nosave(a+1..j-1), <j..b>, <a..j-1>
#   otherwise infinity. The answer is C(M - x_0, 0, L) for a budget M.
# This is rotor's recurrence with the feasibility conditions made exact: rotor checks the forward
# condition of every split against the worst stage of a..b and the backward of (save) only at the
# base, which the conditions above make precise, so that every schedule fits under the simulator.
#
# NOTE [ Discretisation ]
# Memory is counted in `slots` units of budget/slots bytes; every size is rounded UP to whole slots on
# its own, so a schedule that fits in slots fits in bytes (a sum of rounded-up sizes is at least the sum of
# sizes). Rounding can hide schedules that fit only in exact bytes, so `solve` also plays the baselines
# (no remat, recompute all, every segments(k)) and the least-memory schedule, found in exact bytes, and
# returns the fastest that fits. Since slot sizes only shrink as the budget grows, the result is
# monotone in the budget. Ties go to the dynamic program.
#
# Vectorisation: the table is filled by diagonals d = b - a, with rows stored as E[d, a, m] = C(m, a, a + d) and
# two copies pre-shifted by x_a and xbar_a slots (F and G), so that no gather along m is needed in the inner
# step: for one d and one split t = j - a, every (a, m) is one tensor operation (over blocks of the table: NOTE
# [ Solver threads ]).
#
# NOTE [ Solver threads ]
# 1. The solver never changes torch's thread count and runs on the calling thread: every tensor operation stays under
#    ATen's grain (32768 elements), where torch does not split it over its intra-op threads.
# 2. The table holds the same numbers as one operation per diagonal would.
#
# Implementation notes:
# 1. (rule 1) On a busy machine each split can wait a scheduler slice for a descheduled worker, and
#    `torch.set_num_threads` would change the whole process while a solve runs. So the table is cut into blocks of
#    fewer elements (`_blocks`), the best split is found by a loop over t of elementwise operations (torch splits a
#    reduction along t at any size), and the shifts are gathers over blocks of rows.


def _slots_of(nbytes: int, slots: int, budget: int) -> int:
    return -(-nbytes * slots // budget)  # ceil(nbytes / (budget / slots))


def _forward_need(x: Sequence[int], ftmp: Sequence[int], n: int) -> list[list[int]]:
    """need[a][t] = max(x_{a+1} + ftmp_a, max_{a<k<a+t} x_k + x_{k+1} + ftmp_k) for t in 1..n-a."""
    need: list[list[int]] = []
    for a in range(n):
        row = [0, x[a + 1] + ftmp[a]]
        for k in range(a + 1, n):
            row.append(max(row[-1], x[k] + x[k + 1] + ftmp[k]))
        need.append(row)
    return need


_GRAIN = 32768  # ATen's `internal::GRAIN_SIZE`: an elementwise CPU operation over fewer elements runs on one thread


def _blocks(rows: int, cols: int) -> list[tuple[slice, slice]]:
    """Cut a `rows` x `cols` table into blocks of fewer than `_GRAIN` elements (NOTE [ Solver threads ]).

    >>> [(r.start, r.stop, c.start, c.stop) for r, c in _blocks(3, 20000)]
    [(0, 1, 0, 20000), (1, 2, 0, 20000), (2, 3, 0, 20000)]
    >>> [(r.start, r.stop, c.start, c.stop) for r, c in _blocks(1, 40000)]
    [(0, 1, 0, 32767), (0, 1, 32767, 40000)]
    """
    width = min(cols, _GRAIN - 1)
    height = max(1, (_GRAIN - 1) // width)
    return [
        (slice(r, min(r + height, rows)), slice(c, min(c + width, cols)))
        for r in range(0, rows, height)
        for c in range(0, cols, width)
    ]


def _shift(out: torch.Tensor, rows: torch.Tensor, by: torch.Tensor, arange: torch.Tensor) -> None:
    """out[a, m] = rows[a, m - by[a]], infinite where m < by[a]; block by block (NOTE [ Solver threads ])."""
    for r, c in _blocks(rows.shape[0], rows.shape[1]):
        idx = arange[None, c] - by[r, None]
        out[r, c] = torch.gather(rows[r], 1, idx.clamp(min=0)).masked_fill_(idx < 0, _INF)


def _solve_dp(
    stages: Sequence[StageCost], budget: int, input_bytes: int, slots: int
) -> tuple[float, list[tuple[str, int]]] | None:
    """The slot dynamic program of NOTE [ Rotor recurrence ]: (time, ops), or None if infeasible."""
    n = len(stages)
    x = [input_bytes] + [s.output_bytes for s in stages] + [0]
    xbar = [0] + [s.saved_bytes for s in stages] + [0]
    xs = [_slots_of(v, slots, budget) for v in x]
    xbs = [_slots_of(v, slots, budget) for v in xbar]
    fts = [_slots_of(s.forward_temp, slots, budget) for s in stages] + [0]
    bts = [_slots_of(s.backward_temp, slots, budget) for s in stages] + [0]
    uf = [float(s.forward_time) for s in stages] + [0.0]
    ub = [float(s.backward_time) for s in stages] + [0.0]
    top = slots - xs[0]
    if top < 0:
        return None
    size = top + 1  # C(m, a, b) is only ever needed for m <= top
    dt = torch.float64
    ar = torch.arange(size)
    xs_t, xbs_t = torch.tensor(xs[: n + 1]), torch.tensor(xbs[: n + 1])
    # Only E[d, a] for a <= n - d is ever written or read, so the tables start empty.
    E = torch.empty((n + 1, n + 1, size), dtype=dt)  # E[d, a, m] = C(m, a, a + d)
    F = torch.empty_like(E)  # F[d, a, m] = C(m - x_a, a, a + d) + sum(u_f[:a])
    G = torch.empty_like(E)  # G[d, a, m] = C(m - xbar_a, a, a + d)
    choice: list[torch.Tensor] = [torch.zeros(0)]
    # d = 0: the base cases.
    base_need = [max(xs[a + 1] + xbs[a + 1] + fts[a], xs[a + 1] + xbs[a + 1] + xs[a] + bts[a]) for a in range(n)] + [
        xs[n]
    ]
    base_cost = torch.tensor([uf[a] + ub[a] for a in range(n + 1)], dtype=dt)
    need_t = torch.tensor(base_need)
    prefix = torch.cumsum(torch.tensor([0.0, *uf], dtype=dt), 0)
    for r, c in _blocks(n + 1, size):
        E[0, r, c] = torch.where(ar[None, c] >= need_t[r, None], base_cost[r, None], _INF)
    _shift_rows(E, F, G, 0, n + 1, xs_t, xbs_t, prefix, ar)
    fneed = _forward_need(xs, fts, n)  # [a][t], see _forward_need
    save_fwd = [xbs[a + 1] + fts[a] for a in range(n)]
    save_bwd = [xbs[a + 1] + xs[a + 1] + xs[a] + bts[a] for a in range(n)]
    for d in range(1, n + 1):
        cnt = n + 1 - d  # a = 0 .. n - d, b = a + d
        chosen = torch.empty((cnt, size), dtype=torch.int64)
        save_need = torch.tensor([max(xs[d + 1 + a] + save_fwd[a], save_bwd[a]) for a in range(cnt)])
        rows = [[xs[d + 1 + a] + fneed[a][t] for t in range(1, d + 1)] for a in range(cnt)]  # non-decreasing in t
        need = torch.tensor(rows)
        for r, c in _blocks(cnt, size):
            slot = ar[None, c]
            splits = max(bisect.bisect_right(rows[a], c.stop - 1) for a in range(r.start, r.stop))  # the rest: inf
            best, split = _best_split(E, F, d, r, c, slot, need[r], splits)
            best -= prefix[r, None]
            # (save): u_f[a] + u_b[a] + C(m - xbar_{a+1}, a + 1, b)
            save = G[d - 1, r.start + 1 : r.stop + 1, c] + base_cost[r, None]
            save.masked_fill_(slot < save_need[r, None], _INF)
            use_save = save <= best
            E[d, r, c] = torch.where(use_save, save, best)
            chosen[r, c] = torch.where(use_save, 0, split)
        choice.append(chosen)
        _shift_rows(E, F, G, d, cnt, xs_t, xbs_t, prefix, ar)
    value = float(E[n, 0, top])
    if value == _INF:
        return None
    return value, _ops_of(choice, n, top, xs, xbs)


def _ops_of(choice: Sequence[torch.Tensor], n: int, top: int, xs: Sequence[int],
              xbs: Sequence[int]) -> list[tuple[str, int]]:
    """The ops of the schedule the dynamic program chose (`choice[d][a, m]`: 0 to save stage a, else the split).
    `todo` holds sub-chains (a, b, m) and, as (-1, i, 0), a backward(i) to emit once the sub-chain pushed after it
    is done."""
    ops: list[tuple[str, int]] = []
    todo: list[tuple[int, int, int]] = [(0, n, top)]
    while todo:
        a, b, m = todo.pop()
        if a < 0:
            ops.append(("backward", b))
        elif a == b:
            ops += [("loss", n)] if a == n else [("forward_save", a), ("backward", a)]
        elif (t := int(choice[b - a][a, m])) == 0:
            ops.append(("forward_save", a))
            todo += [(-1, a, 0), (a + 1, b, m - xbs[a + 1])]
        else:
            j = a + t
            ops += [("forward_checkpoint", a)] + [("forward_nosave", k) for k in range(a + 1, j)]
            todo += [(a, j - 1, m), (j, b, m - xs[j])]
    return ops


def _best_split(
    E: torch.Tensor, F: torch.Tensor, d: int, r: slice, c: slice, slot: torch.Tensor, need: torch.Tensor, splits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the block (a in `r`, m in `c`) of diagonal `d`: the least time over the splits t = 1..d, prefix[a] not
    yet taken off, and the first t that reaches it (as a minimum over t returns it). `slot`: the block's m as a
    row; `need[a, t - 1]`: the least m at which split t's forward fits; no split after the first `splits` fits in
    the block (they would only add infinities)."""
    # (split j = a + t): sum u_f[a..j-1] + C(m - x_j, j, b) + C(m, a, j - 1), where the sum is
    # prefix[j] - prefix[a]: prefix[j] is inside F.
    best = F[d - 1, r.start + 1 : r.stop + 1, c] + E[0, r, c]
    best.masked_fill_(slot < need[:, :1], _INF)
    split = torch.ones(best.shape, dtype=torch.int64)
    total, short = torch.empty_like(best), torch.empty_like(best, dtype=torch.bool)
    better = torch.empty_like(short)
    for t in range(2, splits + 1):
        torch.add(F[d - t, r.start + t : r.stop + t, c], E[t - 1, r, c], out=total)
        torch.lt(slot, need[:, t - 1 : t], out=short)
        total.masked_fill_(short, _INF)
        torch.lt(total, best, out=better)
        split.masked_fill_(better, t)
        torch.minimum(best, total, out=best)
    return best, split


def _shift_rows(
    E: torch.Tensor, F: torch.Tensor, G: torch.Tensor, d: int, cnt: int, xs_t: torch.Tensor, xbs_t: torch.Tensor,
    prefix: torch.Tensor, ar: torch.Tensor,
) -> None:
    """Fill F[d, :cnt] and G[d, :cnt], the rows E[d, :cnt] shifted by x_a and by xbar_a slots (F plus prefix[a])."""
    _shift(F[d, :cnt], E[d, :cnt], xs_t[:cnt], ar)
    _shift(G[d, :cnt], E[d, :cnt], xbs_t[:cnt], ar)
    for r, c in _blocks(cnt, E.shape[2]):
        F[d, r, c] += prefix[r, None]


def _least_memory(stages: Sequence[StageCost], input_bytes: int) -> tuple[int, list[tuple[str, int]]]:
    """The smallest budget any schedule of NOTE [ Rotor recurrence ] needs, in exact bytes, and a
    schedule that needs it (the fastest among those of least memory at every sub-chain)."""
    n = len(stages)
    x = [input_bytes] + [s.output_bytes for s in stages] + [0]
    xbar = [0] + [s.saved_bytes for s in stages] + [0]
    ft = [s.forward_temp for s in stages] + [0]
    bt = [s.backward_temp for s in stages] + [0]
    uf = [float(s.forward_time) for s in stages] + [0.0]
    ub = [float(s.backward_time) for s in stages] + [0.0]
    fneed = _forward_need(x, ft, n)
    # best[a][b] = (memory, time, choice) with choice 0 = save, t > 0 = split at a + t.
    best = [[(0, 0.0, 0)] * (n + 1) for _ in range(n + 1)]
    for a in range(n):
        need = max(x[a + 1] + xbar[a + 1] + ft[a], x[a + 1] + xbar[a + 1] + x[a] + bt[a])
        best[a][a] = (need, uf[a] + ub[a], 0)
    best[n][n] = (x[n], 0.0, 0)
    for d in range(1, n + 1):
        for a in range(n + 1 - d):
            b = a + d
            sub = best[a + 1][b]
            cand = (
                max(x[b + 1] + xbar[a + 1] + ft[a], xbar[a + 1] + x[a + 1] + x[a] + bt[a], xbar[a + 1] + sub[0]),
                uf[a] + ub[a] + sub[1],
                0,
            )
            fsum = 0.0
            row = best[a]
            for t in range(1, d + 1):
                j = a + t
                fsum += uf[j - 1]
                right, left = best[j][b], row[j - 1]
                mem = max(x[b + 1] + fneed[a][t], x[j] + right[0], left[0])
                if mem < cand[0] or (mem == cand[0] and fsum + right[1] + left[1] < cand[1]):
                    cand = (mem, fsum + right[1] + left[1], t)
            row[b] = cand
    ops: list[tuple[str, int]] = []
    todo: list[tuple[int, int]] = [(0, n)]  # as in _solve_dp; (-1, i) is a pending backward(i)
    while todo:
        a, b = todo.pop()
        if a < 0:
            ops.append(("backward", b))
        elif a == b:
            ops += [("loss", n)] if a == n else [("forward_save", a), ("backward", a)]
        elif (t := best[a][b][2]) == 0:
            ops.append(("forward_save", a))
            todo += [(-1, a), (a + 1, b)]
        else:
            ops += [("forward_checkpoint", a)] + [("forward_nosave", k) for k in range(a + 1, a + t)]
            todo += [(a, a + t - 1), (a + t, b)]
    return x[0] + best[0][n][0], ops


def smallest_budget(stages: Sequence[StageCost], *, input_bytes: int) -> int:
    """The smallest budget, in bytes, under which some schedule of the chain fits the model.

    >>> smallest_budget([StageCost(1.0, 2.0, 1, 2)] * 10, input_bytes=1)
    6
    """
    stages = check_stages(stages)
    check_bytes("input_bytes", input_bytes)
    return _least_memory(stages, input_bytes)[0]


def solve(stages: Sequence[StageCost], budget: int, *, input_bytes: int, slots: int = 500) -> Schedule:
    """Find the fastest schedule of a chain whose peak memory fits `budget` under the model.

    Runs rotor's dynamic program (NOTE [ Rotor recurrence ]) with memory counted in `slots` units of
    `budget / slots` bytes, sizes rounded up (NOTE [ Discretisation ]), so the schedule's simulated peak
    never exceeds the budget. The budget covers everything the model counts, the chain input
    (`input_bytes`) included; a loss stage of zero cost follows the last stage.

    Args:
        stages: the costs of the chain's stages, in order.
        budget: the memory budget in bytes.
        input_bytes: bytes of the chain's input (rotor's x_0).
        slots: how many units the budget is cut into; more is finer and slower (O(slots * L^3)).

    Returns:
        The fastest schedule found; `schedule.peak_bytes <= budget`.

    Raises:
        BudgetError: no schedule fits; the message names the smallest budget that does.
        ValueError: an argument is out of range.

    >>> stages = [StageCost(1.0, 2.0, output_bytes=1, saved_bytes=2)] * 10
    >>> schedule = solve(stages, 12, input_bytes=1, slots=12)
    >>> schedule.makespan, schedule.peak_bytes <= 12
    (37.0, True)
    """
    stages = check_stages(stages)
    check_bytes("input_bytes", input_bytes)
    check_bytes("budget", budget)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"remat: `slots` must be an int >= 1, but got {slots!r}.")
    least, least_ops = _least_memory(stages, input_bytes)
    if budget < least:
        raise BudgetError(
            f"remat: no schedule of this chain of {len(stages)} stages fits a budget of {budget} "
            f"bytes ({format_bytes(budget)}); the smallest feasible budget is {least} bytes "
            f"({format_bytes(least)}). Raise the budget to at least that.",
            least_bytes=least,
        )
    found = _solve_dp(stages, budget, input_bytes, slots) if budget > 0 else None
    candidates: list[Schedule] = []
    if found is not None:
        schedule = Schedule.from_ops(stages, found[1], input_bytes=input_bytes, budget=budget, name="optimal")
        if schedule.peak_bytes > budget or not math.isclose(schedule.makespan, found[0], rel_tol=1e-9):
            raise RematError(f"remat: the solver's schedule breaks its own model; {BUG}.")
        candidates.append(schedule)
    candidates.append(Schedule.from_ops(stages, least_ops, input_bytes=input_bytes, name="least memory"))
    candidates.append(Schedule.no_remat(stages, input_bytes=input_bytes))
    candidates.append(Schedule.recompute_all(stages, input_bytes=input_bytes))
    candidates += [Schedule.segments(stages, k, input_bytes=input_bytes) for k in range(2, len(stages) + 1)]
    fits = [p for p in candidates if p.peak_bytes <= budget]
    best = min(fits, key=lambda p: p.makespan)  # min keeps the first of equals: the DP's schedule
    return Schedule(
        ops=best.ops,
        makespan=best.makespan,
        peak_bytes=best.peak_bytes,
        stages=stages,
        input_bytes=input_bytes,
        budget=budget,
        name="optimal",
        _rows=best._rows,
    )

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
