"""The rotor-style solver: the fastest schedule of a chain of stages under a memory budget.

The solver works on paper, without tensors: each stage is described by a `StageCost` (its forward and
backward times, the bytes of its output and of everything it keeps for backward), `solve` finds the
fastest schedule that fits a budget, and a `Plan` lists the operations with the time and peak memory
that the model predicts. `remat.chain` profiles real modules into `StageCost`s and runs the `Plan`.

The model is rotor's persistent model (Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova, "Optimal
checkpointing for heterogeneous chains", arXiv 1911.13214); see NOTE [ Memory model ] for the exact
accounting and NOTE [ Rotor recurrence ] for the dynamic program.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch

from .._errors import BUG, BudgetError, RematError

__all__ = ["OpKind", "Plan", "StageCost", "solve"]

OpKind = Literal["forward_nosave", "forward_checkpoint", "forward_save", "backward", "loss"]
_KINDS: frozenset[str] = frozenset(("forward_nosave", "forward_checkpoint", "forward_save", "backward", "loss"))
_INF = math.inf

# NOTE [ Memory model ]
# A chain has L stages 0..L-1 followed by a loss stage L of zero cost. a_i is the activation entering
# stage i (a_0 is the chain input, x_0 = input_bytes bytes; a_{i+1}, the output of stage i, has
# x_{i+1} = output_bytes bytes). Running stage i with grad keeps abar_{i+1}: everything the stage
# saves for backward, its output a_{i+1} included (xbar_{i+1} = saved_bytes bytes). The gradient
# delta_i with respect to a_i has x_i bytes; the loss's own output and gradient count 0 bytes.
#
# Operations, and what they hold (`_Machine` is the one simulator every plan goes through):
#   forward_nosave(i)      run stage i without grad from a_i; a_{i+1} is a transient: it must be used
#                          by the next operation. a_i is released if it was itself a transient.
#   forward_checkpoint(i)  the same, but a_i is kept (a checkpoint) until backward(i).
#   forward_save(i)        run stage i with grad: abar_{i+1} is kept until backward(i); a_i is kept
#                          until backward(i) too (backward reads its gradient there).
#   loss                   run the loss on a_L and its backward: delta_L appears, a_L is released
#                          (unless it lives inside abar_L).
#   backward(i)            from delta_{i+1}, abar_{i+1} and a_i compute delta_i; then abar_{i+1},
#                          delta_{i+1} and a_i are released.
# The chain input a_0 is held until backward(0). Live bytes are the sum of the kept activations (one
# inside a live abar is not counted twice), the live abar's, the transient and the current gradient.
# An operation's peak is the live bytes before it plus what it creates: x_{i+1} (+ forward_temp) for a
# forward without grad, xbar_{i+1} (+ forward_temp) with grad, x_i (+ backward_temp) for a backward,
# x_L for the loss. A plan's peak is the largest operation peak; its makespan the sum of the times.


@dataclass(frozen=True)
class StageCost:
    """What one stage of a chain costs, in rotor's persistent model (see NOTE [ Memory model ]).

    Args:
        forward_time: time of one forward of the stage (rotor's u_f), any unit.
        backward_time: time of its backward (rotor's u_b), in the same unit.
        output_bytes: bytes of the stage's output (rotor's x_{i+1}); its gradient has the same size.
        saved_bytes: bytes the stage keeps when run with grad, its output included (rotor's
            xbar_{i+1}); at least `output_bytes`.
        forward_temp: extra bytes held only while the forward runs.
        backward_temp: extra bytes held only while the backward runs.

    Raises:
        ValueError: a time is negative or not finite, a size is negative or not an integer, or
            `saved_bytes` is below `output_bytes`.

    >>> StageCost(forward_time=1.0, backward_time=2.0, output_bytes=1024, saved_bytes=3072)
    StageCost(forward_time=1.0, backward_time=2.0, output_bytes=1024, saved_bytes=3072, \
forward_temp=0, backward_temp=0)
    """

    forward_time: float
    backward_time: float
    output_bytes: int
    saved_bytes: int
    forward_temp: int = 0
    backward_temp: int = 0

    def __post_init__(self) -> None:
        for name in ("forward_time", "backward_time"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"remat: StageCost.{name} must be a number, but got {value!r}.")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"remat: StageCost.{name} must be finite and >= 0, but got {value!r}.")
        for name in ("output_bytes", "saved_bytes", "forward_temp", "backward_temp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"remat: StageCost.{name} must be an int >= 0 (bytes), but got {value!r}.")
        if self.saved_bytes < self.output_bytes:
            raise ValueError(
                "remat: StageCost.saved_bytes counts everything the stage keeps for backward, its "
                f"output included, so it must be >= output_bytes ({self.output_bytes}), but got "
                f"{self.saved_bytes}."
            )


_Snapshot = tuple[frozenset[int], frozenset[int], frozenset[int], int | None, int, int]


class _InvalidOp(ValueError):
    """An operation that the model does not allow at this point of a schedule."""


@dataclass(frozen=True)
class _Row:
    kind: str
    stage: int
    time: float
    peak: int
    live: int


class _Machine:
    """Plays operations under NOTE [ Memory model ], tracking live bytes exactly."""

    def __init__(self, stages: Sequence[StageCost], input_bytes: int) -> None:
        n = len(stages)
        self.n = n
        self.x = [input_bytes] + [s.output_bytes for s in stages] + [0]  # x_0 .. x_{L+1}
        self.xbar = [0] + [s.saved_bytes for s in stages] + [0]  # xbar_0 (unused) .. xbar_{L+1}
        self.stages = stages
        self.kept: set[int] = {0}  # activations held until their stage's backward
        self.own: set[int] = {0}  # the kept ones counted on their own (not inside a live abar)
        self.saved: set[int] = set()  # stages i whose abar_{i+1} is live
        self.transient: int | None = None
        self.grad = n + 1  # delta_{L+1}: none yet
        self.live = input_bytes

    def snapshot(self) -> _Snapshot:
        return (
            frozenset(self.kept),
            frozenset(self.own),
            frozenset(self.saved),
            self.transient,
            self.grad,
            self.live,
        )

    def restore(self, snap: _Snapshot) -> None:
        kept, own, saved, self.transient, self.grad, self.live = snap
        self.kept, self.own, self.saved = set(kept), set(own), set(saved)

    @property
    def done(self) -> bool:
        return self.grad == 0

    def _available(self, i: int) -> bool:
        return i in self.kept or (i - 1) in self.saved or self.transient == i

    def _keep(self, i: int) -> None:
        # Keeping a_i costs nothing new: its bytes are live already, as the transient (which it
        # stops being) or inside abar_i.
        if self.transient == i:
            self.transient = None
            if i in self.own:  # a second copy of a kept activation: drop the copy
                self.live -= self.x[i]
            self.own.add(i)
        self.kept.add(i)

    def _release(self, i: int) -> None:
        self.kept.discard(i)
        if i in self.own:
            self.own.discard(i)
            self.live -= self.x[i]

    def step(self, kind: str, i: int) -> tuple[float, int]:
        """Apply one operation; return its time and its peak bytes (raises `_InvalidOp`)."""
        n = self.n
        if kind == "loss":
            if self.grad != n + 1 or not self._available(n):
                raise _InvalidOp("loss needs a_L and must come once, before any backward")
            peak = self.live + self.x[n]
            if self.transient == n:
                self.live -= self.x[n]
                self.transient = None
            self.live += self.x[n]
            self.grad = n
            return 0.0, peak
        if not 0 <= i < n:
            raise _InvalidOp(f"no stage {i}")
        stage = self.stages[i]
        if kind == "backward":
            if self.grad != i + 1 or i not in self.saved or self.transient is not None:
                raise _InvalidOp(f"backward({i}) needs delta_{i + 1} and abar_{i + 1}")
            peak = self.live + self.x[i] + stage.backward_temp
            self.saved.discard(i)
            self.live -= self.xbar[i + 1] + self.x[i + 1]  # abar_{i+1} and delta_{i+1}
            self._release(i)
            self.live += self.x[i]  # delta_i
            self.grad = i
            return stage.backward_time, peak
        if kind not in _KINDS:
            raise _InvalidOp(f"unknown operation {kind!r}")
        if i >= self.grad or not self._available(i):
            raise _InvalidOp(f"{kind}({i}) needs a_{i}, before backward({i})")
        if self.transient is not None and self.transient != i:
            raise _InvalidOp(f"a_{self.transient} was computed and never used")
        if kind == "forward_save":
            if i in self.saved:
                raise _InvalidOp(f"abar_{i + 1} is already live")
            peak = self.live + self.xbar[i + 1] + stage.forward_temp
            self._keep(i)
            self.saved.add(i)
            self.live += self.xbar[i + 1]
            return stage.forward_time, peak
        peak = self.live + self.x[i + 1] + stage.forward_temp
        if kind == "forward_checkpoint":
            self._keep(i)
        elif self.transient == i:
            self.transient = None
            self.live -= self.x[i]
        self.transient = i + 1
        self.live += self.x[i + 1]
        return stage.forward_time, peak


def _simulate(
    stages: Sequence[StageCost], ops: Iterable[tuple[str, int]], input_bytes: int
) -> tuple[tuple[tuple[OpKind, int], ...], tuple[_Row, ...]]:
    machine = _Machine(stages, input_bytes)
    out_ops: list[tuple[OpKind, int]] = []
    rows: list[_Row] = []
    for kind, i in ops:
        try:
            time, peak = machine.step(kind, i)
        except _InvalidOp as exc:
            raise ValueError(f"remat: invalid schedule at step {len(rows)}: {exc}.") from None
        out_ops.append((kind, i))  # type: ignore[arg-type]  # checked by step
        rows.append(_Row(kind, i, time, peak, machine.live))
    if not machine.done:
        raise ValueError("remat: invalid schedule: it does not back-propagate every stage.")
    return tuple(out_ops), tuple(rows)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError(BUG)  # pragma: no cover


@dataclass(frozen=True)
class Plan:
    """A schedule of a chain with its predicted makespan and peak memory.

    Every plan, whether found by `solve` or built by a baseline, is played once through the same
    simulator of NOTE [ Memory model ], which gives `makespan` and `peak_bytes` in exact bytes.

    Attributes:
        ops: the operations in order, each `(kind, stage)`; kind is one of "forward_nosave",
            "forward_checkpoint", "forward_save", "backward", "loss" (the loss's stage is the
            number of stages).
        makespan: predicted total time, in the unit of the stage times.
        peak_bytes: predicted peak of live bytes, the chain input included.
        budget: the budget the plan was solved for, if any.
        name: what made the plan ("optimal", "no remat", "recompute all", "segments(k)", ...).

    >>> stages = [StageCost(1.0, 2.0, output_bytes=1, saved_bytes=2)] * 3
    >>> plan = Plan.no_remat(stages, input_bytes=1)
    >>> plan.makespan, plan.peak_bytes
    (9.0, 9)
    """

    ops: tuple[tuple[OpKind, int], ...]
    makespan: float
    peak_bytes: int
    stages: tuple[StageCost, ...] = field(repr=False)
    input_bytes: int = field(repr=False)
    budget: int | None = None
    name: str = "plan"
    _rows: tuple[_Row, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def from_ops(
        cls,
        stages: Sequence[StageCost],
        ops: Iterable[tuple[str, int]],
        *,
        input_bytes: int,
        budget: int | None = None,
        name: str = "plan",
    ) -> Plan:
        """Build a plan from explicit operations, simulating them under the model.

        Args:
            stages: the chain's stage costs.
            ops: the operations, `(kind, stage)` pairs.
            input_bytes: bytes of the chain input.
            budget: the budget to record on the plan (not checked).
            name: a label shown by `str(plan)`.

        Returns:
            The plan with its simulated makespan and peak bytes.

        Raises:
            ValueError: the operations are not a valid schedule of the chain.

        >>> s = [StageCost(1.0, 1.0, output_bytes=4, saved_bytes=8)]
        >>> Plan.from_ops(s, [("forward_save", 0), ("loss", 1), ("backward", 0)],
        ...               input_bytes=4).peak_bytes
        20
        """
        stages = _check_stages(stages)
        _check_bytes("input_bytes", input_bytes)
        out_ops, rows = _simulate(stages, ops, input_bytes)
        return cls(
            ops=out_ops,
            makespan=math.fsum(r.time for r in rows),
            peak_bytes=max(r.peak for r in rows),
            stages=stages,
            input_bytes=input_bytes,
            budget=budget,
            name=name,
            _rows=rows,
        )

    @classmethod
    def no_remat(cls, stages: Sequence[StageCost], *, input_bytes: int) -> Plan:
        """Every stage runs once with grad and keeps what it saves (plain autograd).

        >>> Plan.no_remat([StageCost(1.0, 2.0, 1, 2)] * 2, input_bytes=1).makespan
        6.0
        """
        n = len(stages)
        ops: list[tuple[str, int]] = [("forward_save", i) for i in range(n)]
        ops += [("loss", n)] + [("backward", i) for i in reversed(range(n))]
        return cls.from_ops(stages, ops, input_bytes=input_bytes, name="no remat")

    @classmethod
    def recompute_all(cls, stages: Sequence[StageCost], *, input_bytes: int) -> Plan:
        """Every stage is rematerialized: forward keeps only each stage's input, backward runs each
        stage again with grad just before its backward (what `@remat` on every stage does).

        >>> Plan.recompute_all([StageCost(1.0, 2.0, 1, 2)] * 2, input_bytes=1).makespan
        8.0
        """
        n = len(stages)
        ops: list[tuple[str, int]] = [("forward_checkpoint", i) for i in range(n)]
        ops.append(("loss", n))
        for i in reversed(range(n)):
            ops += [("forward_save", i), ("backward", i)]
        return cls.from_ops(stages, ops, input_bytes=input_bytes, name="recompute all")

    @classmethod
    def segments(cls, stages: Sequence[StageCost], k: int, *, input_bytes: int) -> Plan:
        """Uniform segments, as `torch.utils.checkpoint.checkpoint_sequential(stages, k, x)` runs.

        The first `k - 1` segments of `len(stages) // k` stages are checkpointed (only their input is
        kept; backward runs the segment again with grad); the last segment, with the remaining
        stages, runs with grad. `k = 1` is `no_remat`.

        Raises:
            ValueError: `k` is not in `1..len(stages)`.

        >>> Plan.segments([StageCost(1.0, 2.0, 1, 2)] * 4, 2, input_bytes=1).makespan
        14.0
        """
        n = len(stages)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise ValueError(f"remat: segments must be an int in 1..{n} (stages), but got {k!r}.")
        size = n // k
        bounds = [(s, s + size) for s in range(0, size * (k - 1), size)]
        last = bounds[-1][1] if bounds else 0
        ops: list[tuple[str, int]] = []
        for start, stop in bounds:
            ops += [("forward_checkpoint", start)] + [("forward_nosave", i) for i in range(start + 1, stop)]
        ops += [("forward_save", i) for i in range(last, n)] + [("loss", n)]
        ops += [("backward", i) for i in reversed(range(last, n))]
        for start, stop in reversed(bounds):
            ops += [("forward_save", i) for i in range(start, stop)]
            ops += [("backward", i) for i in reversed(range(start, stop))]
        return cls.from_ops(stages, ops, input_bytes=input_bytes, name=f"segments({k})")

    def extra_forwards(self) -> int:
        """How many forwards run beyond one per stage (the recomputation the plan pays for).

        >>> Plan.recompute_all([StageCost(1.0, 2.0, 1, 2)] * 3, input_bytes=1).extra_forwards()
        3
        """
        return sum(kind.startswith("forward") for kind, _ in self.ops) - len(self.stages)

    def __str__(self) -> str:
        budget = "" if self.budget is None else f", budget {_fmt_bytes(self.budget)}"
        head = (
            f"remat plan ({self.name}): {len(self.stages)} stages, {len(self.ops)} ops, makespan "
            f"{self.makespan:.6g}, peak {_fmt_bytes(self.peak_bytes)}{budget}"
        )
        rows = self._rows or _simulate(self.stages, self.ops, self.input_bytes)[1]
        lines = [head, f"{'step':>5}  {'op':<18} {'stage':>5} {'time':>10} {'peak':>12} {'live':>12}"]
        for n, r in enumerate(rows):
            lines.append(
                f"{n:>5}  {r.kind:<18} {r.stage:>5} {r.time:>10.4g} {_fmt_bytes(r.peak):>12} {_fmt_bytes(r.live):>12}"
            )
        return "\n".join(lines)


def _check_bytes(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"remat: `{name}` must be an int >= 0 (bytes), but got {value!r}.")


def _check_stages(stages: Sequence[StageCost]) -> tuple[StageCost, ...]:
    stages = tuple(stages)
    if not stages:
        raise ValueError("remat: a chain needs at least one stage, but got none.")
    for n, s in enumerate(stages):
        if not isinstance(s, StageCost):
            raise TypeError(f"remat: stage {n} must be a remat.StageCost, but got {type(s).__name__}.")
    return stages


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
# base, which the conditions above make precise, so that every plan fits under the simulator.
#
# NOTE [ Discretisation ]
# Memory is counted in `slots` units of budget/slots bytes; every size is rounded UP to whole slots on
# its own, so a plan that fits in slots fits in bytes (a sum of rounded-up sizes is at least the sum of
# sizes). Rounding can hide plans that fit only in exact bytes, so `solve` also plays the baselines
# (no remat, recompute all, every segments(k)) and the least-memory plan, found in exact bytes, and
# returns the fastest that fits. Since slot sizes only shrink as the budget grows, the result is
# monotone in the budget. Ties go to the dynamic program.
#
# Vectorisation: the table is filled by diagonals d = b - a; for one d every (a, split, m) is one
# tensor operation over (a, j - a, m), with rows stored as E[d, a, m] = C(m, a, a + d) and two copies
# pre-shifted by x_a and xbar_a slots (F and G), so no gather along m is needed in the inner step.


# NOTE [ Solver threads ]
# The table is filled by a few thousand tensor operations of a few MB each. With torch's intra-op
# thread pool on a busy machine (more runnable threads than cores) each of them can wait a scheduler
# slice for a descheduled worker: measured on 2 cores under load, 100 stages x 500 slots went from
# 0.6 s on one thread to 3-7 s on two. So the solver runs on one intra-op thread, restoring the
# previous count afterwards; a lock and a depth count keep concurrent solves from restoring out of
# order. Only tensor operations issued while a solve runs are affected, and only in speed.
_threads_lock = threading.Lock()
_threads_depth = 0
_threads_saved = 1


@contextmanager
def _one_thread() -> Iterator[None]:
    global _threads_depth, _threads_saved
    with _threads_lock:
        if _threads_depth == 0:
            _threads_saved = torch.get_num_threads()
            if _threads_saved != 1:
                torch.set_num_threads(1)
        _threads_depth += 1
    try:
        yield
    finally:
        with _threads_lock:
            _threads_depth -= 1
            if _threads_depth == 0 and _threads_saved != 1:
                torch.set_num_threads(_threads_saved)


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


def _shift(rows: torch.Tensor, by: torch.Tensor, arange: torch.Tensor) -> torch.Tensor:
    idx = arange[None, :] - by[:, None]
    out = torch.gather(rows, 1, idx.clamp(min=0))
    return out.masked_fill_(idx < 0, _INF)


def _solve_dp(
    stages: Sequence[StageCost], budget: int, input_bytes: int, slots: int
) -> tuple[float, list[tuple[str, int]]] | None:
    """The slot dynamic program of NOTE [ Rotor recurrence ]: (time, ops), or None if infeasible."""
    with _one_thread():  # see NOTE [ Solver threads ]
        return _solve_dp_unguarded(stages, budget, input_bytes, slots)


def _solve_dp_unguarded(
    stages: Sequence[StageCost], budget: int, input_bytes: int, slots: int
) -> tuple[float, list[tuple[str, int]]] | None:
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
    E[0] = torch.where(ar[None, :] >= need_t[:, None], base_cost[:, None], _INF)
    prefix = torch.cumsum(torch.tensor([0.0, *uf], dtype=dt), 0)
    F[0], G[0] = _shift(E[0], xs_t, ar) + prefix[: n + 1, None], _shift(E[0], xbs_t, ar)
    fneed = torch.zeros((n + 1, n + 1), dtype=torch.int64)  # [a, t], see _forward_need
    for a, row in enumerate(_forward_need(xs, fts, n)):
        fneed[a, : len(row)] = torch.tensor(row)
    xs_all = torch.tensor(xs)
    save_fwd = torch.tensor([xbs[a + 1] + fts[a] for a in range(n)])
    save_bwd = torch.tensor([xbs[a + 1] + xs[a + 1] + xs[a] + bts[a] for a in range(n)])
    for d in range(1, n + 1):
        cnt = n + 1 - d  # a = 0 .. n - d, b = a + d
        a_idx = torch.arange(cnt)
        t_idx = torch.arange(1, d + 1)
        j_idx = a_idx[:, None] + t_idx[None, :]
        # (split j = a + t): sum u_f[a..j-1] + C(m - x_j, j, b) + C(m, a, j - 1), where the sum is
        # prefix[j] - prefix[a]: prefix[j] is inside F and prefix[a] comes off after the min.
        left = E[:d, :cnt].permute(1, 0, 2)  # [a, t-1, m] = C(m, a, a + t - 1)
        right = F[(d - t_idx)[None, :], j_idx]  # [a, t-1, m] = C(m - x_j, j, b) + prefix[j]
        need = xs_all[d + 1 : d + 1 + cnt, None] + fneed[:cnt, 1 : d + 1]
        total = right.add_(left).masked_fill_(ar[None, None, :] < need[:, :, None], _INF)
        best, arg = total.min(dim=1)
        best -= prefix[:cnt, None]
        # (save): u_f[a] + u_b[a] + C(m - xbar_{a+1}, a + 1, b)
        save_need = torch.maximum(xs_all[d + 1 : d + 1 + cnt] + save_fwd[:cnt], save_bwd[:cnt])
        save = G[d - 1, 1 : cnt + 1] + base_cost[:cnt, None]
        save.masked_fill_(ar[None, :] < save_need[:, None], _INF)
        use_save = save <= best
        E[d, :cnt] = torch.where(use_save, save, best)
        choice.append(torch.where(use_save, 0, arg + 1))
        F[d, :cnt] = _shift(E[d, :cnt], xs_t[:cnt], ar).add_(prefix[:cnt, None])
        G[d, :cnt] = _shift(E[d, :cnt], xbs_t[:cnt], ar)
    value = float(E[n, 0, top])
    if value == _INF:
        return None
    # Rebuild the schedule from the choices; `todo` holds sub-chains (a, b, m) and, as (-1, i, 0),
    # a backward(i) to emit once the sub-chain pushed after it is done.
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
    return value, ops


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
    stages = _check_stages(stages)
    _check_bytes("input_bytes", input_bytes)
    return _least_memory(stages, input_bytes)[0]


def solve(stages: Sequence[StageCost], budget: int, *, input_bytes: int, slots: int = 500) -> Plan:
    """Find the fastest schedule of a chain whose peak memory fits `budget` under the model.

    Runs rotor's dynamic program (NOTE [ Rotor recurrence ]) with memory counted in `slots` units of
    `budget / slots` bytes, sizes rounded up (NOTE [ Discretisation ]), so the plan's simulated peak
    never exceeds the budget. The budget covers everything the model counts, the chain input
    (`input_bytes`) included; a loss stage of zero cost follows the last stage.

    Args:
        stages: the costs of the chain's stages, in order.
        budget: the memory budget in bytes.
        input_bytes: bytes of the chain's input (rotor's x_0).
        slots: how many units the budget is cut into; more is finer and slower (O(slots * L^3)).

    Returns:
        The fastest plan found; `plan.peak_bytes <= budget`.

    Raises:
        BudgetError: no schedule fits; the message names the smallest budget that does.
        ValueError: an argument is out of range.

    >>> stages = [StageCost(1.0, 2.0, output_bytes=1, saved_bytes=2)] * 10
    >>> plan = solve(stages, 12, input_bytes=1, slots=12)
    >>> plan.makespan, plan.peak_bytes <= 12
    (37.0, True)
    """
    stages = _check_stages(stages)
    _check_bytes("input_bytes", input_bytes)
    _check_bytes("budget", budget)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"remat: `slots` must be an int >= 1, but got {slots!r}.")
    least, least_ops = _least_memory(stages, input_bytes)
    if budget < least:
        raise BudgetError(
            f"remat: no schedule of this chain of {len(stages)} stages fits a budget of {budget} "
            f"bytes ({_fmt_bytes(budget)}); the smallest feasible budget is {least} bytes "
            f"({_fmt_bytes(least)}). Raise the budget to at least that."
        )
    found = _solve_dp(stages, budget, input_bytes, slots) if budget > 0 else None
    candidates: list[Plan] = []
    if found is not None:
        plan = Plan.from_ops(stages, found[1], input_bytes=input_bytes, budget=budget, name="optimal")
        if plan.peak_bytes > budget or not math.isclose(plan.makespan, found[0], rel_tol=1e-9):
            raise RematError(f"remat: the solver's plan breaks its own model; {BUG}.")
        candidates.append(plan)
    candidates.append(Plan.from_ops(stages, least_ops, input_bytes=input_bytes, name="least memory"))
    candidates.append(Plan.no_remat(stages, input_bytes=input_bytes))
    candidates.append(Plan.recompute_all(stages, input_bytes=input_bytes))
    candidates += [Plan.segments(stages, k, input_bytes=input_bytes) for k in range(2, len(stages) + 1)]
    fits = [p for p in candidates if p.peak_bytes <= budget]
    best = min(fits, key=lambda p: p.makespan)  # min keeps the first of equals: the DP's plan
    return Plan(
        ops=best.ops,
        makespan=best.makespan,
        peak_bytes=best.peak_bytes,
        stages=stages,
        input_bytes=input_bytes,
        budget=budget,
        name="optimal",
        _rows=best._rows,
    )
