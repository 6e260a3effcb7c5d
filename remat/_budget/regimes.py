"""How a budget's assignments are made and verified: one class per regime, each with the rules it adds to the stages
that the driver runs (driver.py: profile, costs, solve, verify).

* `BudgetRegime`, `remat.apply(model, budget=..., sample=...)`: profiled on a fake twin where one stands in,
  gradients counted by position, verified on the model's first training step where the prediction fits.
* `ShardedRegime`, the same after `fully_shard`: profiled on the rank's real step, verified before `apply` returns.
* `CompiledRegime`, `budget=` with `compile=True`: profiled on the real model, one graph's gradients, verified on
  compiled steps with the prediction's miss taken both ways.
* `MemoryRegime`, `remat.apply(model, memory=...)`: the regime it wraps, verified before `apply` returns from no
  gradients.
* `EngineRegime`, a model whose parameters and gradients an engine owns (DeepSpeed ZeRO), for `budget=` and `memory=`:
  profiled on the engine's fake twin, gradients as the engine keeps them, verified on the first training step.

Each regime holds the request it serves (remat/_core/requests.py: what `remat.apply` was asked besides the budget);
`regime_for` picks the regime a request asks for, and a regime's `planning(model)` the one a plan of the model runs
under now (`ShardedRegime` once `fully_shard` was applied to it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from torch import nn

from .._core.requests import FitRequest, MemoryRequest
from .._measure.sharded import is_sharded
from .._measure.step_peak import compiled_peak, measure_step
from .._sites.integrations import engine_of
from .costs import ModelCost, with_gradients
from .costs_compiled import gradient_bytes, graph_extra, with_graph_gradients
from .profile import Profile, TrainingStep, Twin, fake_stands_in
from .solve import Assignment
from .verify import SLACK, Measure, max_over_ranks, verify, verify_both_ways

if TYPE_CHECKING:
    from .._sites.integrations.deepspeed import DeepSpeed

__all__ = ["COMPILED_ENGINE", "SHARDED_LATER", "BudgetRegime", "CompiledRegime", "EngineRegime", "MemoryRegime",
           "ShardedRegime", "regime_for"]

Place = Callable[[Assignment], None]  # puts an assignment's choices on the blocks


def regime_for(request: FitRequest) -> BudgetRegime:
    """The regime `request` asks for: `CompiledRegime` with `compile`, else `BudgetRegime`; for a `MemoryRequest`,
    that regime in a `MemoryRegime`."""
    regime = CompiledRegime(request) if request.compile else BudgetRegime(request)
    return MemoryRegime(regime) if isinstance(request, MemoryRequest) else regime


class BudgetRegime:
    """`remat.apply(model, budget=..., sample=...)` on eager steps: the default regime.

    1. A block may be kept, under `save_matmuls` (rerun), fully rematerialized, under a policy of `choices=`, and
       under rerun keep some of its matmuls (the parts: NOTE [ Some matmuls ] in costs_derived.py).
    2. It is profiled on a fake twin of the model where one stands in (NOTE [ Planning on fake tensors ] in
       profile.py).
    3. Gradients count where a default loop's backward makes them (NOTE [ Gradients in the budget ] in costs.py).
    4. An assignment whose prediction fits is verified on the model's first training step (NOTE [ The first step ]
       in first_step.py), unless the request's `first_step` is False; one that does not fit, on the sample before
       `remat.apply` returns (NOTE [ Verifying the plan ] in verify.py).
    """

    compiled = False  # whether its steps run as one compiled graph
    offers_parts = True  # whether a block may keep some of its matmuls (rule 1)
    real_steps = True  # whether remat may run a real step of the model to verify a plan (not under an engine)
    twin: Twin | None = None  # how its profile's fake twin is made (None: `fake_state`)
    gradients_kept = True  # whether a step's new gradients live to its end (NOTE [ Gradients in the budget ])

    def __init__(self, request: FitRequest) -> None:
        self.request = request

    def planning(self, model: nn.Module) -> BudgetRegime:
        """The regime a plan of `model` runs under now: `ShardedRegime` once `fully_shard` was applied to it,
        `EngineRegime` while an engine owns it."""
        if is_sharded(model):
            return ShardedRegime(self.request)
        engine = engine_of(model)
        return self if engine is None else EngineRegime(self.request, engine)

    def profiles_on_fake(self, model: nn.Module) -> bool:
        """Whether the profile runs on a fake twin of `model` (rule 2)."""
        return fake_stands_in(model, self.request.strategy)

    def with_gradients(self, model: nn.Module, blocks: Sequence[nn.Module], measured: ModelCost,
                       profile: Profile) -> ModelCost:
        """The costs with the gradients that its steps hold added (rule 3)."""
        return with_gradients(measured, profile.gradients)

    def verifies_later(self) -> bool:
        """Whether an assignment whose prediction fits is left to the model's first training step (rule 4)."""
        return self.request.first_step

    def measure(self, step: TrainingStep, measured: ModelCost, cost: ModelCost, assignment: Assignment) -> int:
        """The tracked peak of one real `step` with `assignment` on its model's blocks, from no gradients as after
        `zero_grad()`: the largest over the ranks (NOTE [ The same plan on every rank ] in verify.py)."""
        return max_over_ranks(measure_step(step.model, step))

    def verify(self, assignment: Assignment, measure: Measure, place: Place, slack: float = SLACK) -> Assignment:
        """Verify `assignment` on real steps before it is kept (NOTE [ Verifying the plan ])."""
        return verify(assignment, measure, place, slack)


class ShardedRegime(BudgetRegime):
    """A plan of a model that `fully_shard` was applied to (NOTE [ Budgets and FSDP2 ]): as `BudgetRegime`, but profiled
    on the rank's real step (its collectives need real tensors: NOTE [ Planning on fake tensors ] in profile.py)
    and verified on the sample before `remat.apply` returns, since its first step cannot stand in."""

    def planning(self, model: nn.Module) -> BudgetRegime:
        return self if is_sharded(model) else BudgetRegime(self.request).planning(model)

    def verifies_later(self) -> bool:
        return False


# NOTE [ Budgets and FSDP2 ]
# 1. A budget bounds what forward and backward allocate on top of what lives before the step. A plan made on the
#    model `fully_shard` was applied to (`ShardedRegime`) is made on the rank's own step, and holds per rank.
# 2. A plan made before `fully_shard` is kept when the model is sharded later, and the first forward after sharding
#    warns once (`SHARDED_LATER`), asking for `remat.apply(model, budget=...)` after `fully_shard`.
# 3. DDP needs nothing: its buckets exist before the step and its gradients are the plain step's (or views into
#    the buckets).
#
# Implementation notes:
# 1. (rule 2) Planned on an unsharded model, a step allocates the activations and the whole gradients; sharded, one
#    rank's step allocates gradients at their shard's size, but each block's parameters all-gathered for its
#    forward and again for its backward, the root's kept unsharded throughout, and each block's whole gradients
#    until they are reduce-scattered. Neither the sign nor the size of the difference follows from the unsharded
#    step (tests/budget/test_sharded_budget.py; docs/benchmarks.md), and planning again inside the sharded root's
#    forward would nest a step in FSDP's own: so the plan is kept and the user is told.
SHARDED_LATER = (
    "remat: the budget of `{model}` was planned by remat.apply(model, budget=...) before `fully_shard`, on the "
    "unsharded step; one rank's sharded step allocates differently (parameters all-gathered per block, gradients "
    "sharded), so the budget does not hold per rank. Call remat.apply(model, budget=..., sample=...) after "
    "`fully_shard` (on every rank) to plan on this rank's step."
)


COMPILED_ENGINE = (
    "remat: apply(..., compile=True) verifies its plan on real compiled steps of `{model}` before it returns, and "
    "{engine} would see them (its gradient reduction, its gathers): leave out compile=True; a plan made in eager "
    "code holds when the model is compiled (its measured peak within the budget +5%)."
)


class CompiledRegime(BudgetRegime):
    """`remat.apply(model, budget=..., compile=True)`: a plan for the model compiled as one graph (NOTE [ Compiled as
    one graph ] in costs_compiled.py).

    1. No part is offered: a policy that keeps some calls works in eager code only (NOTE [ Some calls ] in
       remat/_core/policies.py).
    2. It is profiled on the real model, in eager code; its derived choices are priced as compiled code runs them
       (NOTE [ Compiled costs ] in costs_derived.py), and the sample block's bytes are shifted by what compiling
       saves (NOTE [ Compiled bytes ] in costs_compiled.py).
    3. Every parameter's gradient is alive until the one backward graph returns.
    4. It is verified before `remat.apply` returns, on real compiled steps, the prediction's miss taken both ways
       (NOTE [ Planned on measured steps ] in verify.py).
    """

    compiled = True
    offers_parts = False

    def planning(self, model: nn.Module) -> BudgetRegime:
        engine = engine_of(model)
        if engine is not None:  # its plans are verified on real compiled steps: NOTE [ Budgets under DeepSpeed ZeRO ]
            raise ValueError(COMPILED_ENGINE.format(model=type(model).__name__, engine=engine.name))
        return self

    def profiles_on_fake(self, model: nn.Module) -> bool:
        return False  # its costs are shifted by real compiled runs: NOTE [ Planning on fake tensors ], rule 3

    def with_gradients(self, model: nn.Module, blocks: Sequence[nn.Module], measured: ModelCost,
                       profile: Profile) -> ModelCost:
        return with_graph_gradients(measured, *gradient_bytes(model, blocks))

    def verifies_later(self) -> bool:
        return False

    def measure(self, step: TrainingStep, measured: ModelCost, cost: ModelCost, assignment: Assignment) -> int:
        """The peak of a real compiled step (NOTE [ Measuring a compiled step ] in remat/_measure/step_peak.py);
        where this torch cannot measure one, an eager step lifted by what one graph's gradients add to the
        prediction (NOTE [ Compiled as one graph ], implementation note 2)."""
        peak = compiled_peak(step.model, step)
        if peak is not None:
            return max_over_ranks(peak)
        eager = max_over_ranks(measure_step(step.model, step, grads=False))
        return eager + graph_extra(measured, cost, assignment.choice)

    def verify(self, assignment: Assignment, measure: Measure, place: Place, slack: float = SLACK) -> Assignment:
        return verify_both_ways(assignment, measure, place, slack)


class MemoryRegime(BudgetRegime):
    """The plans of `remat.apply(model, memory=...)` for what a step's state leaves (NOTE [ Total memory ] in
    remat/_apply/memory.py): those of the regime it wraps (`BudgetRegime` or `CompiledRegime`), except that

    1. every one is verified on the sample before `remat.apply` returns, without `SLACK`: going over is an
       out-of-memory error, not a missed promise;
    2. on eager steps from no gradients, compiled or not: the gradients take from the same memory, and eager code
       keeps each one to the step's end, as a one-graph backward does.
    """

    def __init__(self, inner: BudgetRegime) -> None:
        super().__init__(inner.request)
        self.inner = inner
        self.compiled = inner.compiled
        self.offers_parts = inner.offers_parts

    def planning(self, model: nn.Module) -> BudgetRegime:
        engine = engine_of(model)  # verified on its first step: NOTE [ Budgets under DeepSpeed ZeRO ], rule 4
        return self if engine is None else EngineRegime(self.request, engine)

    def profiles_on_fake(self, model: nn.Module) -> bool:
        return self.inner.profiles_on_fake(model)

    def with_gradients(self, model: nn.Module, blocks: Sequence[nn.Module], measured: ModelCost,
                       profile: Profile) -> ModelCost:
        return self.inner.with_gradients(model, blocks, measured, profile)

    def verifies_later(self) -> bool:
        return False

    def verify(self, assignment: Assignment, measure: Measure, place: Place, slack: float = SLACK) -> Assignment:
        return self.inner.verify(assignment, measure, place, slack=1.0)  # rule 1: no slack


class EngineRegime(BudgetRegime):
    """A plan of a model whose parameters and gradients an engine owns, or will (DeepSpeed ZeRO: NOTE [ Budgets
    under DeepSpeed ZeRO ] in remat/_sites/integrations/deepspeed.py), for `budget=` and `memory=` alike.

    1. It is profiled on the engine's fake twin: each parameter at the shape the step computes with (ZeRO-3's
       partitioned ones too), none of the engine's hooks on the modules, so the engine sees no step.
    2. Where the engine takes each gradient as backward makes it (ZeRO-2, ZeRO-3), gradients count only while
       backward makes them.
    3. It is verified on the model's first training step, the engine's own buffers set apart there (NOTE [ Set
       apart ] in remat/_measure/step_tracker.py), also where the prediction does not fit: remat runs no real
       step that the engine would see.
    """

    real_steps = False

    def __init__(self, request: FitRequest, engine: DeepSpeed) -> None:
        super().__init__(request)
        self.engine = engine
        self.twin = engine.twin
        self.gradients_kept = not engine.hands_over

    def planning(self, model: nn.Module) -> BudgetRegime:
        return self

    def profiles_on_fake(self, model: nn.Module) -> bool:
        return True

    def with_gradients(self, model: nn.Module, blocks: Sequence[nn.Module], measured: ModelCost,
                       profile: Profile) -> ModelCost:
        return super().with_gradients(model, blocks, measured, profile) if self.gradients_kept else measured

    def verifies_later(self) -> bool:
        return True
