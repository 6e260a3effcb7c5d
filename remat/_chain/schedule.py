"""`Schedule`: a schedule of a chain with its predicted makespan and peak, and the baseline schedules."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .._core.public import claim
from .._core.units import format_bytes
from .simulate import OpKind, StageCost, _SimRow, check_bytes, check_stages, simulate

__all__ = ["CHAIN_BYTES", "Schedule"]

CHAIN_BYTES = "the chain's activations and their gradients, its input included, parameters and their gradients not"
"""What a chain's peak counts (NOTE [ Memory model ] in simulate.py): what `remat.chain`'s budget bounds."""


@dataclass(frozen=True)
class Schedule:
    """A schedule of a chain with its predicted makespan and peak bytes (its activations and their gradients).

    Every schedule, whether found by `solve` or built by a baseline, is played once through the same
    simulator of NOTE [ Memory model ], which gives `makespan` and `peak_bytes` in exact bytes.

    Attributes:
        ops: the operations in order, each `(kind, stage)`; kind is one of "forward_nosave",
            "forward_checkpoint", "forward_save", "backward", "loss" (the loss's stage is the
            number of stages).
        makespan: predicted total time, in the unit of the stage times.
        peak_bytes: predicted peak of live bytes: the chain's activations and their gradients, the chain input
            included, parameters and their gradients not (what `remat.chain`'s budget bounds).
        budget: the budget the schedule was solved for, if any.
        name: what made the schedule ("optimal", "no remat", "recompute all", "segments(k)", ...).

    >>> stages = [StageCost(1.0, 2.0, output_bytes=1, saved_bytes=2)] * 3
    >>> schedule = Schedule.no_remat(stages, input_bytes=1)
    >>> schedule.makespan, schedule.peak_bytes
    (9.0, 9)
    """

    ops: tuple[tuple[OpKind, int], ...]
    makespan: float
    peak_bytes: int
    stages: tuple[StageCost, ...] = field(repr=False)
    input_bytes: int = field(repr=False)
    budget: int | None = None
    name: str = "schedule"
    _rows: tuple[_SimRow, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def from_ops(
        cls,
        stages: Sequence[StageCost],
        ops: Iterable[tuple[str, int]],
        *,
        input_bytes: int,
        budget: int | None = None,
        name: str = "schedule",
    ) -> Schedule:
        """Build a schedule from explicit operations, simulating them under the model.

        Args:
            stages: the chain's stage costs.
            ops: the operations, `(kind, stage)` pairs.
            input_bytes: bytes of the chain input.
            budget: the budget to record on the schedule (not checked).
            name: a label shown by `str(schedule)`.

        Returns:
            The schedule with its simulated makespan and peak bytes.

        Raises:
            ValueError: the operations are not a valid schedule of the chain.

        >>> s = [StageCost(1.0, 1.0, output_bytes=4, saved_bytes=8)]
        >>> Schedule.from_ops(s, [("forward_save", 0), ("loss", 1), ("backward", 0)],
        ...               input_bytes=4).peak_bytes
        20
        """
        stages = check_stages(stages)
        check_bytes("input_bytes", input_bytes)
        out_ops, rows = simulate(stages, ops, input_bytes)
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
    def no_remat(cls, stages: Sequence[StageCost], *, input_bytes: int) -> Schedule:
        """Every stage runs once with grad and keeps what it saves (plain autograd).

        >>> Schedule.no_remat([StageCost(1.0, 2.0, 1, 2)] * 2, input_bytes=1).makespan
        6.0
        """
        n = len(stages)
        ops: list[tuple[str, int]] = [("forward_save", i) for i in range(n)]
        ops += [("loss", n)] + [("backward", i) for i in reversed(range(n))]
        return cls.from_ops(stages, ops, input_bytes=input_bytes, name="no remat")

    @classmethod
    def recompute_all(cls, stages: Sequence[StageCost], *, input_bytes: int) -> Schedule:
        """Every stage is rematerialized: forward keeps only each stage's input, backward runs each
        stage again with grad just before its backward (what `@remat` on every stage does).

        >>> Schedule.recompute_all([StageCost(1.0, 2.0, 1, 2)] * 2, input_bytes=1).makespan
        8.0
        """
        n = len(stages)
        ops: list[tuple[str, int]] = [("forward_checkpoint", i) for i in range(n)]
        ops.append(("loss", n))
        for i in reversed(range(n)):
            ops += [("forward_save", i), ("backward", i)]
        return cls.from_ops(stages, ops, input_bytes=input_bytes, name="recompute all")

    @classmethod
    def segments(cls, stages: Sequence[StageCost], k: int, *, input_bytes: int) -> Schedule:
        """Uniform segments, as `torch.utils.checkpoint.checkpoint_sequential(stages, k, x)` runs.

        The first `k - 1` segments of `len(stages) // k` stages are checkpointed (only their input is
        kept; backward runs the segment again with grad); the last segment, with the remaining
        stages, runs with grad. `k = 1` is `no_remat`.

        Raises:
            ValueError: `k` is not in `1..len(stages)`.

        >>> Schedule.segments([StageCost(1.0, 2.0, 1, 2)] * 4, 2, input_bytes=1).makespan
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
        """How many forwards run beyond one per stage (the recomputation the schedule pays for).

        >>> Schedule.recompute_all([StageCost(1.0, 2.0, 1, 2)] * 3, input_bytes=1).extra_forwards()
        3
        """
        return sum(kind.startswith("forward") for kind, _ in self.ops) - len(self.stages)

    def __str__(self) -> str:
        budget = "" if self.budget is None else f", budget {format_bytes(self.budget)}"
        head = (
            f"remat schedule ({self.name}): {len(self.stages)} stages, {len(self.ops)} ops, makespan "
            f"{self.makespan:.6g}, peak {format_bytes(self.peak_bytes)}{budget} (peak and live: {CHAIN_BYTES})"
        )
        rows = self._rows or simulate(self.stages, self.ops, self.input_bytes)[1]
        lines = [head, f"{'step':>5}  {'op':<18} {'stage':>5} {'time':>10} {'peak':>12} {'live':>12}"]
        for n, r in enumerate(rows):
            peak, live = format_bytes(r.peak), format_bytes(r.live)
            lines.append(f"{n:>5}  {r.kind:<18} {r.stage:>5} {r.time:>10.4g} {peak:>12} {live:>12}")
        return "\n".join(lines)

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
