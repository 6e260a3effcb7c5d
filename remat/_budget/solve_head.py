"""Stage 3, solve, with the head: the chunked head as a choice of a budget's plan (`remat.apply(model, budget=... |
memory=...)`), routed where only that fits (NOTE [ The head as a choice ]).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from .._core.errors import BudgetError
from .._engine import stats as _stats
from .._sites.head import can_route_head, route_head, routed_by, unroute_head
from .solve import Assignment

__all__ = ["BY_BUDGET", "Fitting", "fit_choosing_head"]

# NOTE [ The head as a choice ]
# `remat.apply(model, head=True)` computes a causal LM's loss in chunks (`linear_cross_entropy`), which lowers the
# peak of every plan by the logits it never holds, at no cost in time (the same matmuls). A budget may need it.
#
# Rules:
# 1. With `head=None` (apply's default) a budget or memory plan of a model whose head `head=True` routes plans
#    with the model's own head first; where no choice per block fits, it routes the head and plans again for the
#    same bytes (a fraction is of the step's peak without remat with the model's own head: what the user's loop
#    measures without remat). The plan with the routed head is kept if it fits; otherwise the head is put back and
#    the refusal is the routed plan's, which names a smaller least budget.
# 2. `head=True` routes the head before planning, whatever the budget, and a fractional budget is still of the
#    step without remat with the model's own head (`remat.apply` turns it into bytes on the sample first, on fake
#    tensors: a re-plan for a new input shape then keeps those bytes); a head routed by an earlier
#    `remat.apply(model, head=True)` stays routed; `head=False` never routes the head.
# 3. A head the budget routed shows in `remat.plan(model)` as chosen by it, and every re-plan (a new input shape)
#    chooses again: first without it.
# 4. Only where it is needed, although it costs no time: a routed head changes the model's output (`logits` is
#    None in training with labels), which a loop that reads the logits would notice; a budget is asked to fit the
#    step, not to change what the model returns where it need not.
#
# Implementation notes:
# 1. (rule 1) `BudgetHook.fit_blocks` records the bytes its budget resolved to on the costs (`resolved`); the
#    second plan is made for those bytes, with the budget given back afterwards so that a re-plan resolves a
#    fraction again.
# 2. (rule 1) A second plan that made no chunk of logits (the sample has no `labels`, so the routed head never
#    ran) or that raised something else (a `loss=` that reads the logits) is no plan: the first refusal stands.

BY_BUDGET = "the budget"
"""What a head routed by the planner says chose it (`remat.plan(model)`)."""


class Fitting(Protocol):
    """What `fit_choosing_head` needs of a budget's hook (`BudgetHook` in apply.py)."""

    budget: int | float  # the budget it plans for, parsed
    resolved: int | None  # that budget in bytes on the last costs

    @property
    def head(self) -> bool | None:
        """apply's `head`."""

    def fit_blocks(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Assignment: ...


def fit_choosing_head(hook: Fitting, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Assignment:
    """`hook.fit_blocks(model, args, kwargs)`, with the head routed where only that fits (NOTE [ The head as a
    choice ])."""
    if hook.head is not None or not can_route_head(model):
        return hook.fit_blocks(model, args, kwargs)
    chosen = routed_by(model)
    if chosen is not None and chosen != BY_BUDGET:  # routed by an earlier `remat.apply(model, head=True)`: kept
        return hook.fit_blocks(model, args, kwargs)
    if chosen == BY_BUDGET:  # rule 3: a re-plan chooses again
        unroute_head(model)
    try:
        return hook.fit_blocks(model, args, kwargs)
    except BudgetError as refused:
        resolved = hook.resolved
        if resolved is None:
            raise
        given, made = hook.budget, _stats.head_chunks
        route_head(model, chosen_by=BY_BUDGET)
        hook.budget = resolved  # implementation note 1
        try:
            assignment = hook.fit_blocks(model, args, kwargs)
        except BudgetError:
            unroute_head(model)
            if _stats.head_chunks == made:
                raise refused from None  # implementation note 2
            raise
        except Exception:
            unroute_head(model)
            raise refused from None
        finally:
            hook.budget = given
        if _stats.head_chunks == made:  # cannot happen with a plan that fits where the first did not; be safe
            unroute_head(model)
            raise refused from None
        return assignment
