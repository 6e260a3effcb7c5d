"""`remat.apply(model, budget=... | memory=...)`: the arguments a planned apply takes, and the planner it runs.

A budget (`_fit.apply_budget`) bounds the activations; a memory (`_total_memory.apply_memory`) bounds the whole
step and leaves the activations what the state does not take. Both load the profiler and planner only here, on
the first planned apply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ._fit import apply_budget
from ._options import Strategy
from ._plan.units import Budget
from ._policies import PolicyLike
from ._total_memory import apply_memory

__all__ = ["apply_planned"]


def apply_planned(
    model: nn.Module, where: Any, *, budget: Budget | None, memory: Budget | None, optimizer: Any, sample: Any,
    loss: Callable[[Any], Any] | None, choices: Sequence[PolicyLike] | None, replan: bool, compile: bool,
    preserve_rng: bool, strategy: Strategy, check: bool,
) -> nn.Module:
    """See `remat.apply`: route to the budget's planner or the total memory's, once their arguments agree."""
    if memory is None and optimizer is None:
        assert budget is not None
        return apply_budget(model, budget, sample, where, loss=loss, choices=choices, replan=replan,
                            preserve_rng=preserve_rng, strategy=strategy, check=check, compile=compile)
    if memory is None or budget is not None:
        raise ValueError("remat: apply takes either `budget` (activations) or `memory` (the whole step, with "
                         "`optimizer`), not both; `optimizer` goes with `memory`.")
    options = {"choices": choices, "replan": replan, "preserve_rng": preserve_rng, "strategy": strategy,
               "check": check, "compile": compile}
    return apply_memory(model, memory, sample, where, optimizer=optimizer, loss=loss, options=options)
