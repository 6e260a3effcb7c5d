"""`remat.chain`: a sequence of stages run under the fastest schedule that fits a memory budget.

`chain` profiles each stage on a sample (`remat._chain.stages`: forward and backward time, bytes
of its output, of what it saves for backward, and of its temporaries), asks `remat._chain.solver.solve`
for a schedule, and runs that schedule through one custom autograd function, rotor-style: forward runs the
operations up to the loss, and the function's backward runs the rest, recomputing stages from kept
activations (see NOTE [ Chain execution ]). Stages take and return a single tensor.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .._core.errors import RematError
from .._core.public import claim
from .._core.units import Budget, parse_budget
from .._engine.autocast import AutocastState
from .._engine.compiled import compiling
from .._engine.guard import keep_buffers
from .._engine.rng import RngStash, devices_of
from .lowered import lower, run_lowered
from .solver import Schedule, solve
from .stages import backward_stage, check_tensor, grad_input, profile_stages, stage_params, writer

_log = logging.getLogger("remat")

__all__ = ["Chain", "chain", "parse_budget"]

# NOTE [ Chain execution ]
# A chain runs its schedule's operations (NOTE [ Memory model ] in simulate.py) in one autograd Function, dropping
# each activation exactly when the model drops it, so the memory follows the schedule.
#
# Rules:
# 1. The operations split at "loss". `_ChainFunction` runs the first part in its forward and returns a_L; its
#    backward receives delta_L and runs the rest: recomputations, and backward(i) = the gradients of stage i's
#    input and parameters from its kept output and delta_{i+1}.
# 2. Parameters are inputs of the function, so their gradients are returned to autograd (hooks,
#    torch.autograd.grad and DDP see them as usual).
# 3. RNG: each stage's first run (always in forward, in order) draws from the caller's generators as a plain
#    nn.Sequential would; every recomputation sees the same random numbers, and the caller's stream is untouched.
# 4. Buffers (BatchNorm statistics) move once per forward; autocast is as forward had it.
# 5. The function's backward runs once: backward with retain_graph=True twice raises an error.
#
# Implementation notes:
# 1. (rule 1) forward_nosave / forward_checkpoint run the stage without grad; forward_save runs it with grad on a
#    detached input that requires grad, keeping (input, output) and the small graph between them. backward(i)
#    goes through `backward_stage`, which lets autograd free both as it consumes them (NOTE [ Backward frees as it
#    goes ]; no reference to them is left here).
# 2. (rule 3) The state before a stage's first run is stashed, and every recomputation runs inside a fork set to
#    that state, so dropout masks match.
# 3. (rule 4) Recomputations (and profiling) run under the engine's `keep_buffers`, which sends their writes to
#    copies (NOTE [ Writes during recompute ]); a recomputation that read a buffer a stage changes after reading it
#    raises (NOTE [ Buffers read before forward changed them ]). Autocast is captured and re-entered as the rerun
#    engine does (`AutocastState`).


class _FnStage(nn.Module):
    """A plain callable as a stage (it has no parameters, so `state_dict` keys do not change)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


_CHANGED_INPUT = (
    "remat: stage {i} of the chain ({stage}) changed its input in place ({op}: its version went from {before} to "
    "{after}), on an input where profiling it on the chain's sample did not. remat.chain keeps the outputs of the "
    "stages before it to recompute from them, and a recompute would start from the changed value: wrong gradients. "
    "Make that operation out of place (for example `inplace=False`), or profile the chain on an input where the "
    "stage changes its input too (`sample=`), so that it runs on a copy of its input."
)


class _ChainRun:
    """One forward and backward of a chain under a schedule (see NOTE [ Chain execution ])."""

    def __init__(self, chain: Chain, schedule: Schedule, x: torch.Tensor, params: tuple[torch.Tensor, ...]) -> None:
        self.stages: list[nn.Module] = list(chain)
        self.n = len(self.stages)
        ops = schedule.ops
        cut = ops.index(("loss", self.n))
        self.forward_ops, self.backward_ops = ops[:cut], ops[cut + 1 :]
        self.devices = devices_of([x], module=chain)
        self.rng: dict[int, RngStash] = {}
        self.acts: dict[int, torch.Tensor] = {}
        self.kept: set[int] = {0}
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.x_requires_grad = x.requires_grad
        self.position = {id(p): k for k, p in enumerate(params)}
        self.stage_params = [stage_params(s) for s in self.stages]
        self.grads: list[torch.Tensor | None] = [None] * len(params)
        self.grad: torch.Tensor | None = None  # the current delta_{i+1}
        self.autocast = AutocastState.capture(self.devices)
        self.copies = chain.copies  # stages run on a copy of their input: NOTE [ A stage that changes its input ]

    def _input(self, i: int) -> torch.Tensor:
        if i in self.acts:
            return self.acts[i]
        return self.saved[i - 1][1].detach()

    def _run(self, i: int, inp: torch.Tensor) -> torch.Tensor:
        version = inp._version
        given = inp.clone() if i in self.copies else inp  # NOTE [ A stage that changes its input ] in stages.py
        if i not in self.rng:  # the first run: in forward, from the caller's generators
            self.rng[i] = RngStash.capture(self.devices)
            out = self.stages[i](given)
        else:
            with (
                self.rng[i].restore(),
                keep_buffers(site=f"stage {i} of the chain ({type(self.stages[i]).__name__})"),
                AutocastState.enter(self.autocast, self.devices),
            ):
                out = self.stages[i](given)
        if inp._version != version:
            with self.rng[i].restore(), keep_buffers(), torch.no_grad():
                op = writer(self.stages[i], inp)
            raise RematError(_CHANGED_INPUT.format(
                i=i, stage=type(self.stages[i]).__name__, op=op or "an in-place op", before=version,
                after=inp._version,
            ))
        return check_tensor(out, f"the output of stage {i}")

    def apply(self, kind: str, i: int) -> None:
        if kind == "loss":
            self.acts.pop(self.n, None)
            return
        if kind == "backward":
            self._backward(i)
            return
        a = self._input(i)
        if kind == "forward_save":
            inp = grad_input(a, i > 0 or self.x_requires_grad)
            with torch.enable_grad():
                out = self._run(i, inp)
            self.saved[i] = (inp, out)
            self.kept.add(i)
            self.acts[i] = inp.detach()
            self.acts[i + 1] = out.detach()
            return
        with torch.no_grad():
            out = self._run(i, a)
        if kind == "forward_checkpoint":
            self.kept.add(i)
        elif i not in self.kept:
            self.acts.pop(i, None)
        self.acts[i + 1] = out

    def _backward(self, i: int) -> None:
        inp, out = self.saved.pop(i)
        self.acts.pop(i + 1, None)
        self.acts.pop(i, None)
        self.kept.discard(i)
        grad, self.grad = self.grad, None
        if grad is None or not out.requires_grad:
            return
        params = self.stage_params[i]
        wrt = ([inp] if inp.requires_grad else []) + list(params)
        if not wrt:
            return
        held = [out, grad]  # see NOTE [ Backward frees as it goes ]
        del out, grad
        grads = backward_stage(held, wrt)
        if inp.requires_grad:
            self.grad, grads = grads[0], grads[1:]
        for p, g in zip(params, grads, strict=True):
            if g is not None:
                k = self.position[id(p)]
                prev = self.grads[k]
                self.grads[k] = g if prev is None else prev + g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.acts[0] = x.detach()
        for kind, i in self.forward_ops:
            self.apply(kind, i)
        out = self._input(self.n)
        self.acts.pop(self.n, None)
        return out

    def backward(self, grad: torch.Tensor) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        self.grad = grad
        for kind, i in self.backward_ops:
            self.apply(kind, i)
        dx = self.grad if self.x_requires_grad else None
        self.acts.clear()
        self.saved.clear()
        return dx, self.grads


class _ChainFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: _ChainRun, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run = run
        return run.forward(x)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        run: _ChainRun | None = ctx.run
        ctx.run = None
        if run is None:
            raise RematError(
                "remat: a remat.chain graph was back-propagated twice; the chain frees its "
                "activations as its backward runs, so retain_graph=True is not supported. Run the "
                "chain forward again instead."
            )
        dx, grads = run.backward(grad)
        return (None, dx, *grads)


class Chain(nn.Sequential):
    """An `nn.Sequential` that runs its stages under a budgeted schedule. Build it with `chain`.

    Its children, parameters and `state_dict` keys are those of the stages given to `chain`.

    Attributes:
        schedule: the `Schedule` for the last input shape profiled (None before the first).
    """

    def __init__(
        self,
        stages: nn.Sequential | Sequence[nn.Module | Callable[[torch.Tensor], torch.Tensor]],
        *,
        budget: Budget | None = None,
        segments: int | None = None,
    ) -> None:
        if isinstance(stages, nn.Sequential):
            named: OrderedDict[str, nn.Module] = OrderedDict(stages.named_children())
        else:
            if isinstance(stages, (torch.Tensor, str)) or not isinstance(stages, Sequence):
                raise TypeError(
                    "remat: `stages` must be an nn.Sequential or a list of modules or callables, "
                    f"but got {type(stages).__name__}."
                )
            named = OrderedDict()
            for n, s in enumerate(stages):
                if not callable(s):
                    raise TypeError(f"remat: stage {n} must be an nn.Module or a callable, but got {type(s).__name__}.")
                named[str(n)] = s if isinstance(s, nn.Module) else _FnStage(s)
        if not named:
            raise ValueError("remat: `chain` needs at least one stage, but got none.")
        if (budget is None) == (segments is None):
            raise ValueError(
                "remat: give `chain` exactly one of `budget` (bytes, '1.5GiB' or a fraction) and "
                f"`segments` (an int), but got budget={budget!r}, segments={segments!r}."
            )
        if segments is not None and (
            isinstance(segments, bool) or not isinstance(segments, int)
            or not 1 <= segments <= len(named)
        ):  # fmt: skip
            raise ValueError(
                f"remat: `segments` must be an int in 1..{len(named)} (the number of stages), but got {segments!r}."
            )
        super().__init__(named)
        self._budget = None if budget is None else parse_budget(budget)
        self._segments = segments
        self._schedules: dict[tuple[Any, ...], tuple[Schedule, frozenset[int]]] = {}
        self.schedule: Schedule | None = None
        # the stages run on a copy of their input, for the last input shape profiled (NOTE [ A stage that changes its
        # input ] in stages.py)
        self.copies: frozenset[int] = frozenset()
        self._told = False  # whether profiling a new shape inside a forward was logged (once per chain)
        self._lowered = lower(None, len(self))  # the schedule inside compiled frames: NOTE [ Chains under compile ]

    @staticmethod
    def _key(x: torch.Tensor) -> tuple[Any, ...]:
        return (tuple(x.shape), x.dtype, x.device)

    @property
    def plan(self) -> Schedule | None:
        """Deprecated: the same as `schedule` (renamed, so that "plan" means `remat.plan`'s table alone)."""
        warnings.warn("remat: `Chain.plan` is renamed `Chain.schedule`; `plan` will be removed.", DeprecationWarning,
                      stacklevel=2)
        return self.schedule

    def plan_for(self, x: torch.Tensor) -> Schedule:
        """Deprecated: the same as `schedule_for` (renamed with `plan`)."""
        warnings.warn("remat: `Chain.plan_for` is renamed `Chain.schedule_for`; `plan_for` will be removed.",
                      DeprecationWarning, stacklevel=2)
        return self.schedule_for(x)

    def schedule_for(self, x: torch.Tensor) -> Schedule:
        """Return the schedule for inputs like `x`, profiling the stages on `x` the first time.

        Profiling runs each stage forward and backward on `x` without changing the caller's RNG
        stream, the stages' buffers or any `.grad`.

        Raises:
            BudgetError: no schedule fits the budget for this input shape.
        """
        key = self._key(x)
        found = self._schedules.get(key)
        if found is None:
            if self._schedules and not getattr(self, "_told", False):
                self._told = True
                _log.warning(
                    "remat: the chain was called with a new input shape %s: profiling its stages and planning again "
                    "inside this forward (once per new shape; a chain schedules for each shape it sees). Logged once "
                    "per chain.", tuple(x.shape),
                )
            stages = list(self)
            with RngStash.capture(devices_of([x], module=self)).restore(), keep_buffers():
                costs, input_bytes, copies = profile_stages(stages, x)
            if self._segments is not None:
                schedule = Schedule.segments(costs, self._segments, input_bytes=input_bytes)
            else:
                budget = self._budget
                if isinstance(budget, float):
                    full = Schedule.no_remat(costs, input_bytes=input_bytes).peak_bytes
                    budget = max(1, math.floor(budget * full))
                assert budget is not None
                schedule = solve(costs, budget, input_bytes=input_bytes)
            found = self._schedules[key] = (schedule, copies)
        schedule, self.copies = found
        self.schedule = schedule
        self._lowered = lower(schedule, len(self))
        return schedule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor(x, "the chain's input")
        params = tuple(dict.fromkeys(p for p in self.parameters() if p.requires_grad))
        if not torch.is_grad_enabled() or not (x.requires_grad or params):
            for stage in self:
                x = stage(x)
            return x
        if compiling():  # see NOTE [ Chains under compile ] in lowered.py
            return run_lowered(list(self), self._lowered, x)
        schedule = self.schedule_for(x)
        run = _ChainRun(self, schedule, x, params)
        # `apply` is an untyped def up to torch 2.13, an attribute of type Any from 2.14: one ignore for both
        out: torch.Tensor = _ChainFunction.apply(run, x, *params)  # type: ignore[no-untyped-call, unused-ignore]
        return out


def chain(
    stages: nn.Sequential | Sequence[nn.Module | Callable[[torch.Tensor], torch.Tensor]],
    *,
    budget: Budget | None = None,
    segments: int | None = None,
    sample: torch.Tensor | None = None,
) -> Chain:
    """Run a chain of stages under the fastest schedule that fits a memory budget (rotor-style).

    Each stage is profiled on `sample` (now) or on the first input of each new shape (forward and
    backward time; bytes of its output, of what it saves for backward, of its temporaries); rotor's
    dynamic program (`remat.solve`) then picks which activations to keep, which to recompute and
    when. The budget covers the chain's input and every activation and gradient the model counts
    (see NOTE [ Memory model ] in simulate.py); parameters and their gradients are outside it.
    Stages take and return one tensor: tuples raise a TypeError when first seen. A graph built by
    the chain can be back-propagated once (no retain_graph=True twice, no double backward).

    Args:
        stages: an `nn.Sequential`, or a list of modules or callables taking and returning a tensor.
        budget: bytes (an int, or a string with a unit: "1.5GiB", "800MB"), or a float in (0, 1]:
            that fraction of the chain's peak without remat (its activations and their gradients, the input
            included: `Schedule.no_remat`'s peak).
        segments: instead of a budget, `k` uniform segments as `checkpoint_sequential` runs them.
        sample: an input to profile on now; otherwise the first input is used.

    Returns:
        A `Chain`: an `nn.Sequential` with the same children and `state_dict` keys; `chain.schedule`
        shows the schedule with its predicted peak bytes and time.

    Raises:
        BudgetError: the budget is below the smallest feasible one (named in the message).
        TypeError, ValueError: the arguments are malformed.

    >>> import torch
    >>> from torch import nn
    >>> net = chain([nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)],
    ...             budget=0.7, sample=torch.randn(32, 64))
    >>> net(torch.randn(32, 64)).sum().backward()
    >>> net.schedule.peak_bytes > 0
    True
    """
    built = Chain(stages, budget=budget, segments=segments)
    if sample is not None:
        check_tensor(sample, "`sample`")
        probe = sample.detach().requires_grad_(sample.is_floating_point())
        built.schedule_for(probe)
    return built

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
