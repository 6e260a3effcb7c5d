"""The head as a choice of a budget's plan (`remat.apply(model, budget=... | memory=...)`): whether the driver may
route the model's head, routing it, and whether the routed head ran (NOTE [ The head as a choice ]). The driver
(driver.py) takes the step; this module answers it.
"""

from __future__ import annotations

from torch import nn

from .._engine import stats as _stats
from .._sites.head import can_route_head, route_head, routed_by, switch_head, unroute_head

__all__ = ["BY_BUDGET", "HeadChoice"]

# NOTE [ The head as a choice ]
# `remat.apply(model, head=True)` computes a causal LM's loss in chunks (`linear_cross_entropy`), which lowers the
# peak of every plan by the logits it never holds, at no cost in time (the same matmuls). A budget may need it.
#
# Rules:
# 1. With `head=None` (apply's default) a budget or memory plan of a model whose head `head=True` routes plans
#    with the model's own head first; where no choice per block is predicted to fit, it routes the head and plans
#    again for the same bytes (a fraction is of the step's peak without remat with the model's own head: what the
#    user's loop measures without remat), before any real step: a real step of the blocks without the head would
#    go over the budget (NOTE [ Planning on fake tensors ] in profile.py, rule 1). Where a plan predicted to fit
#    without the head is refused by its real steps, the head is routed and the plan made again the same way. A
#    refusal of the plan with the routed head is its own, and names a smaller least budget; the head is put back.
# 2. `head=True` routes the head before planning, whatever the budget, and a fractional budget is still of the
#    step without remat with the model's own head (`remat.apply` turns it into bytes on the sample first, on fake
#    tensors: a re-plan for a new input shape then keeps those bytes); a head routed by an earlier
#    `remat.apply(model, head=True)` stays routed, and a fraction is of the step without it as well (the same
#    bytes as `head=True` in one call); `head=False` never routes the head, and takes off one that an earlier
#    `remat.apply`'s budget routed.
# 3. A head the budget routed shows in `remat.plan(model)` as chosen by it, and every re-plan (a new input shape)
#    chooses again: first without it. A re-plan that fails leaves the head as the plan before it had it.
# 4. Only where it is needed, although it costs no time: a routed head changes the model's output (`logits` is
#    None in training with labels), which a loop that reads the logits would notice; a budget is asked to fit the
#    step, not to change what the model returns where it need not.
#
# Implementation notes:
# 1. (rule 1) The driver solves the plan with the head routed for the bytes its budget resolved to on the costs
#    with the model's own head; the budget itself is never changed, so a re-plan resolves a fraction again.
# 2. (rule 1) A plan with the routed head whose profile made no chunk of logits (the sample has no `labels`, so the
#    routed head never ran) or raised (a `loss=` that reads the logits) is no plan, nor is one that does not fit
#    either and is predicted to hold no less than the plan without it (logits small next to the blocks: rule 4):
#    the head is put back and the plan without it goes on (verified, or refused, on its own).
# 3. (rule 2) The bytes of a fractional budget with `head=True` are found by `own_step_bytes` in
#    remat/_apply/drive.py, which needs the estimator (above this layer).
# 4. (rule 3) A re-plan runs inside the forward of the new shape, from the budget's hook, the model's first forward
#    pre-hook; torch has read the model's hooks for that forward before it. So the earlier plan's route is switched
#    off while the plan chooses, not taken off the model, and on again where the plan routes the head: that forward
#    then runs the head as its plan has it. Only once the plan is made without the head is the route taken off
#    (`HeadChoice.end`); the forward still calls it, and a route taken off opens no call.
# 5. (rule 1) Where the head alone is no better, the driver tries it again once the next choice is taken, the
#    tiles or offload (`reopen`): with the blocks' internals in tiles, or their inputs on the host, the step's peak
#    can move to the logits, which only the head in chunks lowers.

BY_BUDGET = "the budget"
"""What a head routed by the planner says chose it (`remat.plan(model)`)."""


class HeadChoice:
    """The head's choice for one plan of `model` (NOTE [ The head as a choice ]).

    `open` says whether the plan may still route the head: apply's `head` is None, the model has a head to route,
    and no earlier `remat.apply(model, head=True)` routed it. Made at the start of a plan, it switches off a route
    that an earlier plan chose (rule 3, implementation note 4); `end` settles it.
    """

    def __init__(self, model: nn.Module, head: bool | None) -> None:
        self.model = model
        self.routed = False  # whether this plan routed the head
        self.made = 0  # the chunks of logits made by then (`remat._engine.stats`)
        self.tried = self.reopened = False  # routed once; opened again (implementation note 5)
        chosen = routed_by(model)
        if head is False and chosen == BY_BUDGET:  # rule 2: routed by an earlier apply's budget, now not asked for
            unroute_head(model)
            chosen = None
        self.open = head is None and chosen in (None, BY_BUDGET) and can_route_head(model)
        self.earlier = self.open and chosen == BY_BUDGET  # an earlier plan's route, switched off while choosing
        if self.earlier:
            switch_head(model, on=False)

    def route(self) -> None:
        """Route the model's head for the plan (rule 1). Closes the choice: a plan routes the head once."""
        self.open = False
        self.tried = True
        self.made = _stats.head_chunks
        if self.earlier:
            switch_head(self.model, on=True)
        else:
            route_head(self.model, chosen_by=BY_BUDGET)
        self.routed = True

    def reopen(self) -> bool:
        """Open the choice again, once, where this plan routed the head and put it back as no better
        (implementation note 5); whether it did."""
        if self.open or self.routed or not self.tried or self.reopened:
            return False
        self.open = self.reopened = True
        return True

    def ran(self) -> bool:
        """Whether the routed head made a chunk of logits since `route` (implementation note 2)."""
        return self.routed and _stats.head_chunks != self.made

    def take_back(self) -> None:
        """Put back the model's own head, where this plan routed it."""
        if self.routed:
            if self.earlier:
                switch_head(self.model, on=False)
            else:
                unroute_head(self.model)
            self.routed = False

    def end(self, made: bool) -> None:
        """The plan is made (`made`: an earlier plan's route that it did not take goes), or it failed (the head goes
        back to what the plan before it had: rule 3); a plan that fails takes back its own route first."""
        if not made:
            self.take_back()
        if self.earlier and not self.routed:
            if made:
                unroute_head(self.model)
            else:
                switch_head(self.model, on=True)
