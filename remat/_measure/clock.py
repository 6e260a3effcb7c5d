"""The clock a profile reads: the wall clock, or, on fake tensors, ops priced on a nominal device.

NOTE [ Priced time ]
On fake tensors no kernel runs, so a profile's clock prices each op on a nominal device instead of reading the
wall clock: the same model and sample give the same times, and so the same plan, on every machine.

Rules:
1. On fake tensors (`remat.estimate`, or `remat.apply(model, budget=...)` on a model built under
   ``FakeTensorMode``) the wall clock between two marks reads how long fake dispatch took in Python, which
   depends on the machine and its load and says nothing of what the ops would cost: a plan chosen on those times
   could change from one run to the next wherever two plans came close (docs/benchmarks.md). So there `now()`
   reads an `OpClock`: a dispatch mode that advances by a price for every aten op it sees,

       price = LAUNCH + max(flops / FLOPS, elements / ELEMENTS, bytes / BANDWIDTH)   (0: no tensor output)

   on a nominal device of the op's output's type (`_DEVICES`).
2. The prices need not be any one machine's: the planner compares times with times, so what matters is that a
   matmul costs its FLOPs, an elementwise op its elements or bytes, and every op its launch, as recomputation is
   paid for on real devices.
3. On real tensors `remat.apply` times its ops, so its plan moves between runs wherever two plans cost nearly the
   same; the estimate, priced, plans the same peaks on every run, within the real planner's own spread
   (docs/benchmarks.md).

Implementation notes:
1. (rule 1) flops come from torch's FLOP formulas where torch has one (matmuls, convolutions, attention), else
   elements out at ELEMENTS per second (a GELU, a softmax, a dropout mask are compute-bound on a CPU); bytes are
   those of the op's tensor arguments and outputs; a view costs LAUNCH alone. The choices that keep matmul
   outputs run a Python dispatch mode over every op, at MODE_PER_OP each (in place of the calibration of NOTE
   [ Mode cost in place ] in remat/_budget/costs_derived.py).
2. (rule 2) The CPU's numbers are one small x86 core's, rounded (how they were measured: docs/benchmarks.md); the
   accelerator's are a nominal GPU's.
3. (rule 1) The clock is entered below every mode the profile enters (the tracker, `save_matmuls`' mode), just
   above the fake mode: an op reaches it from inside the tracker's dispatch, so its price is on the clock before
   the tracker reads the clock for it (as the op's kernel would have run by then). The corrections for the wall
   clock's errors (the tracker's own time, a block timed alone: NOTE [ Timing under the tracker ] in
   remat/_budget/profile_step.py) have nothing to correct on this clock and are skipped.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any

import torch

from .._core.torch_compat import FakeTensor, flop_formula, local_tensor, tree_leaves
from .._engine.modes import Mode

__all__ = ["OpClock", "clock_for", "now", "price", "priced"]

# per device type: FLOPS, ELEMENTS (per second, an op without a FLOP formula), BANDWIDTH (bytes per second),
# LAUNCH (seconds per op); see NOTE [ Priced time ]. Any other type than the CPU: "accelerator".
_DEVICES = {"cpu": (8e10, 1e9, 5e10, 5e-6), "accelerator": (1e14, 1e12, 2e12, 5e-6)}

MODE_PER_OP = 1e-5  # seconds a Python dispatch mode adds to each op, on any device (NOTE [ Priced time ])

_clocks: list[OpClock] = []  # entered, innermost last; process-wide, as autograd's threads read it too


def now() -> float:
    """Seconds: of the innermost `OpClock` entered, else of the wall clock (``time.perf_counter``)."""
    return _clocks[-1].seconds if _clocks else time.perf_counter()


def priced() -> bool:
    """Whether `now()` reads an `OpClock` (NOTE [ Priced time ])."""
    return bool(_clocks)


def _clock_tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def price(func: Any, args: Any, kwargs: Any, out: Any) -> float:
    """Seconds that the op ``func(*args, **kwargs) -> out`` costs on the nominal device (NOTE [ Priced time ]).

    >>> a = torch.ones(64, 64)
    >>> price(torch.ops.aten.mm.default, (a, a), {}, a @ a) > price(torch.ops.aten.add.Tensor, (a, a), {}, a + a)
    True
    """
    outputs = _clock_tensors(out)
    if not outputs:
        return 0.0
    kind = outputs[0].device.type
    flops_per_s, elements_per_s, bytes_per_s, launch = _DEVICES.get(kind, _DEVICES["accelerator"])
    if getattr(func, "is_view", False):
        return launch
    formula = flop_formula(func)
    seconds = 0.0
    if formula is not None:
        try:
            seconds = int(formula(*args, **(kwargs or {}), out_val=out)) / flops_per_s
        except Exception:  # a formula that does not take these arguments: priced as any other op
            formula = None
    if formula is None:
        seconds = sum(t.numel() for t in outputs) / elements_per_s
    moved = sum(t.numel() * t.element_size() for t in _clock_tensors((args, kwargs)) + outputs)
    return launch + max(seconds, moved / bytes_per_s)


class OpClock(Mode):
    """A clock that advances by the price of every aten op run under it (NOTE [ Priced time ]).

    >>> with OpClock() as clock:
    ...     _ = torch.ones(8, 8) @ torch.ones(8, 8)
    ...     tick = now()
    >>> tick == clock.seconds > 0
    True
    """

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def __enter__(self) -> OpClock:
        super().__enter__()  # type: ignore[no-untyped-call]
        _clocks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _clocks.remove(self)
        super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.seconds += price(func, args, kwargs, out)
        return out


def clock_for(tensors: Iterable[torch.Tensor]) -> contextlib.AbstractContextManager[Any]:
    """An `OpClock` to profile under if any of `tensors` (a model's parameters, a sample; a DTensor by its local
    shard) is a fake tensor, else nothing: the wall clock (NOTE [ Priced time ])."""
    if any(isinstance(local_tensor(t), FakeTensor) for t in tensors):
        return OpClock()
    return contextlib.nullcontext()
