"""The memory model of a chain: `StageCost` and the one simulator every chain schedule is played through.

See NOTE [ Memory model ]. `remat._chain.schedule.Schedule` builds on it, and `remat._chain.solver` finds the fastest
schedule under it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from .._core.public import claim

__all__ = ["OpKind", "StageCost", "check_bytes", "check_stages", "simulate"]

OpKind = Literal["forward_nosave", "forward_checkpoint", "forward_save", "backward", "loss"]
_KINDS: frozenset[str] = frozenset(("forward_nosave", "forward_checkpoint", "forward_save", "backward", "loss"))

# NOTE [ Memory model ]
# A chain has L stages 0..L-1 followed by a loss stage L of zero cost. a_i is the activation entering
# stage i (a_0 is the chain input, x_0 = input_bytes bytes; a_{i+1}, the output of stage i, has
# x_{i+1} = output_bytes bytes). Running stage i with grad keeps abar_{i+1}: everything the stage
# saves for backward, its output a_{i+1} included (xbar_{i+1} = saved_bytes bytes). The gradient
# delta_i with respect to a_i has x_i bytes; the loss's own output and gradient count nothing.
#
# Rules:
# 1. A schedule is a sequence of operations, and each holds (`_Machine` is the one simulator every schedule goes
#    through):
#      forward_nosave(i)      run stage i without grad from a_i; a_{i+1} is a transient: it must be used
#                             by the next operation. a_i is released if it was itself a transient.
#      forward_checkpoint(i)  the same, but a_i is kept (a checkpoint) until backward(i).
#      forward_save(i)        run stage i with grad: abar_{i+1} is kept until backward(i); a_i is kept
#                             until backward(i) too (backward reads its gradient there).
#      loss                   run the loss on a_L and its backward: delta_L appears, a_L is released
#                             (unless it lives inside abar_L).
#      backward(i)            from delta_{i+1}, abar_{i+1} and a_i compute delta_i; then abar_{i+1},
#                             delta_{i+1} and a_i are released.
#    The chain input a_0 is held until backward(0).
# 2. Live bytes are the sum of the kept activations (one inside a live abar is not counted twice), the live
#    abar's, the transient and the current gradient.
# 3. An operation's peak is the live bytes before it plus what it creates: x_{i+1} (+ forward_temp) for a
#    forward without grad, xbar_{i+1} (+ forward_temp) with grad, x_i (+ backward_temp) for a backward, x_L for
#    the loss. A schedule's peak is the largest operation peak; its makespan the sum of the times.
# 4. Parameters and their gradients are outside the model (remat.chain returns parameter gradients to autograd
#    when its backward ends).
#
# Implementation notes (how real runs meet the model: remat.chain; tests/chain/test_chain_memory.py checks the
# tracked peak against it):
# 1. (rule 3) A stage's backward frees abar_{i+1} and delta_{i+1} as autograd consumes them, node by node, as
#    plain autograd and checkpoint_sequential do (NOTE [ Backward frees as it goes ] in stages.py), and
#    backward_temp is measured that way: the peak of the stage's backward above "abar_{i+1} and delta_{i+1}
#    live", less x_i. A multi-node stage (conv, BatchNorm, ReLU) thus costs about x_i, not x_i + x_{i+1} more:
#    counting its output and gradient as held to the end over-counted by up to x_{i+1} per backward.
# 2. (rule 3) forward_temp is the larger of the two forwards' temporaries (with and without grad), so one of the
#    two forwards may be over-counted, never under-counted.
# 3. (rule 1) Not modelled: autograd holds delta_L, the gradient of the chain's output, until the chain's
#    backward returns (it is the argument of that backward), while the model releases it after backward(L-1): a
#    run may exceed the prediction by x_L after that (chains usually end in a small head;
#    tests/chain/test_chain_memory.py allows it).


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
class _SimRow:
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


def simulate(
    stages: Sequence[StageCost], ops: Iterable[tuple[str, int]], input_bytes: int
) -> tuple[tuple[tuple[OpKind, int], ...], tuple[_SimRow, ...]]:
    machine = _Machine(stages, input_bytes)
    out_ops: list[tuple[OpKind, int]] = []
    rows: list[_SimRow] = []
    for kind, i in ops:
        try:
            time, peak = machine.step(kind, i)
        except _InvalidOp as exc:
            raise ValueError(f"remat: invalid schedule at step {len(rows)}: {exc}.") from None
        out_ops.append((kind, i))  # type: ignore[arg-type]  # checked by step
        rows.append(_SimRow(kind, i, time, peak, machine.live))
    if not machine.done:
        raise ValueError("remat: invalid schedule: it does not back-propagate every stage.")
    return tuple(out_ops), tuple(rows)


def check_bytes(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"remat: `{name}` must be an int >= 0 (bytes), but got {value!r}.")


def check_stages(stages: Sequence[StageCost]) -> tuple[StageCost, ...]:
    stages = tuple(stages)
    if not stages:
        raise ValueError("remat: a chain needs at least one stage, but got none.")
    for n, s in enumerate(stages):
        if not isinstance(s, StageCost):
            raise TypeError(f"remat: stage {n} must be a remat.StageCost, but got {type(s).__name__}.")
    return stages

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
