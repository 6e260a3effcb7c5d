"""`remat.apply(model, budget=...)` and `memory=`: the budget's driver. `apply_budget` puts on the model what the
request asks besides a plan (`tiles=N`, `head=True`: remat/_sites/asked.py), and `fit_budget`, which `memory=` and
`remat.estimate` run too, a `BudgetHook`, whose `fit` runs the stages in order, each in the files named after it:

1. profile (profile.py, profile_step.py, profile_alone.py): a few tracked training steps on the sample, marked block
   by block, on a fake twin of the model where one stands in: a `Profile`;
2. costs (costs.py, costs_derived.py, costs_compiled.py): the bytes and times of every block under every choice,
   with the gradients the regime's steps hold: a `ModelCost`;
3. solve (solve.py): one choice per block, the fastest predicted to fit: an `Assignment`; where none is predicted to
   fit, the head's choice (head_choice.py): the stages again with the model's head routed, and where still none
   is, the tiles' choice (tiles_choice.py): the stages again with the blocks' token-wise modules in tiles;
4. verify (verify.py, first_step.py): real tracked steps, before `remat.apply` returns or on the model's first
   training step, that correct the assignment where one went over.

The regime (regimes.py) says how each stage runs for `budget=`, `memory=`, `compile=True` and a sharded model.
`remat.estimate` runs the same driver for its budget rows.

NOTE [ Budgeted models ]
1. A `BudgetHook`, a forward pre-hook on the model, holds what the budget needs: the blocks by qualified name (so
   that `deepcopy` and pickling keep pointing at the copy's own blocks), the choices, the regime, and the assignment
   for the last input signature (shapes, dtypes, devices of the tensors among the inputs).
2. Each block's choice is put on it with the hooks `remat(module)` uses (none for "kept"), so `remat.plan`,
   `remat.undo`, `state_dict` (no key changes) and `deepcopy` treat a budgeted model like any other.
3. A training call (gradients on) with a new input signature plans again before the forward goes on (with
   `replan=True`), on detached copies of the inputs; the planner's own calls of the model pass through the hook
   untouched.
4. A failed plan (`BudgetError`) puts the previous choices back, with the head, the tiles and the offload as the
   previous plan had them (none of them before the first plan).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import nn

from .._core.errors import BudgetError
from .._core.requests import BudgetRequest, FitRequest
from .._core.torch_compat import FakeTensor, eager_for_now, when_traced
from .._core.units import format_bytes
from .._engine.compiled import compiling, in_compiled_call
from .._measure import sharded as _sharded
from .._measure.sample import as_call, detached, signature
from .._measure.step_autocast import StepAutocast
from .._sites.asked import carried, head_asked, tiles_asked
from .._sites.integrations import engine_of
from .._sites.targets import remove_hooks, select
from .choices import Choices
from .costs import ModelCost, measured_costs
from .costs_compiled import warn_one_graph
from .first_step import WINDOW, FirstStep, can_track, tidy
from .head_choice import HeadChoice
from .offload_choice import OffloadChoice
from .profile import TrainingStep, profile
from .regimes import SHARDED_LATER, BudgetRegime, regime_for
from .solve import Assignment, least_assignment, solve_budget
from .tiles_choice import TilesChoice
from .verify import Verification, from_rank_zero, max_over_ranks

if TYPE_CHECKING:
    from .._sites.integrations.deepspeed import DeepSpeed

__all__ = ["BudgetHook", "Solved", "apply_budget", "fit_budget"]

_M = TypeVar("_M", bound=nn.Module)
_log = logging.getLogger("remat")


class Extra(Protocol):
    """A choice the driver takes for the whole model where nothing fits without it: `TilesChoice`,
    `OffloadChoice`."""

    open: bool
    profiled: bool  # whether the profile sees what it changes

    def take(self) -> bool: ...

    def take_back(self) -> None: ...

    def end(self, made: bool) -> None: ...


def apply_budget(model: _M, request: BudgetRequest,
                 own_step_bytes: Callable[[nn.Module, BudgetRequest], int]) -> _M:
    """`remat.apply(model, budget=...)`: the blocks' token-wise modules tiled where `tiles=N` asks (NOTE [ Tiles as a
    choice ], rule 2), the head routed where `head=True` asks (NOTE [ The head as a choice ], rule 2), then the plan
    (`fit_budget`); nothing is left half done where it raises.

    Args:
        model: the model; its blocks are those the request's `where` selects.
        request: the request, its budget as `parse_budget` reads it.
        own_step_bytes: a fractional budget in bytes of the step without remat, with the model's own head and
            untiled, where the model's own step is not the profile's with every block kept (`head=True`, tiles, or
            a head or tiles an earlier `remat.apply` left on it); found before the head is routed (implementation
            note 3 of NOTE [ The head as a choice ]: it needs the estimator, above this layer).
    """
    with tiles_asked(model, request):
        if isinstance(request.budget, float) and (request.head or carried(model) != (False, None)):
            request = dataclasses.replace(request, budget=own_step_bytes(model, request))
        with head_asked(model, request):
            return fit_budget(model, request, request.budget)


def fit_budget(model: _M, request: FitRequest, budget: int | float) -> _M:
    """Plan `model`'s blocks for `budget` on one training step of the request's sample, and keep planning on new
    input signatures (NOTE [ Budgeted models ]): what `apply_budget`, `remat.apply(model, memory=...)` and
    `remat.estimate`'s budget rows run, with what the request asks of the model (tiles, the head) already on it.

    Args:
        model: the model; its blocks are those the request's `where` selects.
        request: what the plan is asked for (a `BudgetRequest`, or a `MemoryRequest` for what the step's state
            leaves); its type and `compile` pick the regime (`regime_for`).
        budget: bytes, or a fraction of the step's peak without remat (as `parse_budget` reads it).
    """
    _no_meta(model)
    blocks = select(model, request.where)
    for _, block in blocks:
        remove_hooks(block)
    for key, old in list(model._forward_pre_hooks.items()):
        if isinstance(old, BudgetHook):
            old.close()
            del model._forward_pre_hooks[key]
            model._forward_pre_hooks_with_kwargs.pop(key, None)
    hook = BudgetHook(budget, tuple(name for name, _ in blocks), regime_for(request.for_replans()))
    args, kwargs = as_call(request.sample)
    hook.fit(model, args, kwargs)
    model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    return model


@dataclass(frozen=True)
class Solved:
    """What stages 1 to 3 give the driver: the costs, the assignment solved on them, and whether it is predicted to
    fit (only a measured step may refuse a budget: NOTE [ Verifying the plan ] in verify.py)."""

    measured: ModelCost  # the profile's costs, before the regime adds its gradients
    cost: ModelCost
    assignment: Assignment
    fits: bool

    @property
    def budget(self) -> int:
        """The budget in bytes on these costs (a fraction resolved: NOTE [ The head as a choice ], rule 1)."""
        return self.assignment.budget


class BudgetHook:
    """The model's forward pre-hook that holds its budget's assignment and plans again on a new input signature
    (NOTE [ Budgeted models ])."""

    _remat_owned = True  # `remat.undo` removes it (see `_targets._is_ours`)

    def __init__(self, budget: int | float, names: tuple[str, ...], regime: BudgetRegime) -> None:
        self.budget = budget  # parsed (`parse_budget`)
        self.names = names
        self.regime = regime
        self.choices = Choices(names, regime)
        self.assignment: Assignment | None = None
        self.signature: tuple[Any, ...] | None = None
        self.autocast: StepAutocast | None = None  # what the plan's steps ran under: NOTE [ Planned under autocast ]
        self.devices: tuple[torch.device, ...] = ()  # where the model was when planned (its autocast types)
        self.sharded = False  # whether the plan was made on a `fully_shard`-ed model: NOTE [ Budgets and FSDP2 ]
        self.engine: DeepSpeed | None = None  # the engine that owned the model when planned: `engine_changed`
        self.verification: Verification | None = None  # waiting for training steps: NOTE [ The first step ]
        self.step: FirstStep | None = None  # the training step being tracked for it
        self.busy = False  # planning: the planner's own calls of the model pass
        self.told = self.told_autocast = self.told_engine = self.told_apart = self.warned = False  # once per model

    @property
    def request(self) -> FitRequest:
        return self.regime.request

    # -- the driver: the stages in order -------------------------------------------------------------------------

    def fit(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Assignment:
        """Plan the blocks for these inputs, stage by stage, and put the assignment on them: profile, costs and
        solve (`_solved`); where nothing is predicted to fit, the same with the head routed, then with the blocks'
        token-wise modules in tiles, then with what the rematerialized blocks keep on the host, before any real step
        (NOTE [ The head as a choice ] in head_choice.py, NOTE [ Tiles as a choice ] in tiles_choice.py, NOTE
        [ Offload as a choice ] in offload_choice.py); then verify (`_verified`)."""
        regime = self.regime.planning(model)
        step = TrainingStep(model, self.request.loss, detached(args), detached(kwargs))
        blocks = [model.get_submodule(name) for name in self.names]
        previous, previous_calls = self.assignment, self.choices.calls
        head = HeadChoice(model, self.request.head)
        extras = (TilesChoice(model, self.names, self.request.tiles, compiled=regime.compiled),
                  OffloadChoice(self.choices, step.devices, self.request.offload, fake=_holds_fakes(model),
                                compiled=regime.compiled))
        self.verification = None
        self.close()
        self.busy = True
        restore = None if in_compiled_call() else eager_for_now()  # compiled blocks: NOTE [ The first step ]
        try:
            with step.planning():
                own = solved = self._solved(step, blocks, regime, self.budget)
                if not solved.fits:
                    solved = self._taken(head, extras, step, blocks, regime, own, solved) or solved
                while True:
                    try:
                        assignment = self._verified(step, regime, solved)
                        break
                    except BudgetError:  # measured over where the prediction fitted: the next choice open
                        taken = self._taken(head, extras, step, blocks, regime, own, solved, first=True)
                        if taken is None:
                            raise
                        solved = taken
        except BaseException:
            for choice in (head, *extras):  # each as the plan before this one had it
                choice.end(made=False)
            self.choices.calls = previous_calls
            for i, block in enumerate(blocks):  # back to the previous choices, or to none
                if previous is None:
                    remove_hooks(block)
                else:
                    self.choices.assign(model, i, previous.choice[i])
            raise
        finally:
            self.busy = False
            if restore is not None:
                restore()
        for choice in (head, *extras):
            choice.end(made=True)
        self.assignment = assignment
        self.autocast, self.devices = step.autocast, step.devices
        self.signature = signature(args, kwargs)
        self.sharded = _sharded.is_sharded(model)  # NOTE [ Budgets and FSDP2 ], rule 2
        self.engine = engine_of(model)  # NOTE [ Budgets under DeepSpeed ZeRO ], rule 5
        return assignment

    def _taken(self, head: HeadChoice, extras: Sequence[Extra], step: TrainingStep, blocks: Sequence[nn.Module],
               regime: BudgetRegime, own: Solved, last: Solved, first: bool = False) -> Solved | None:
        """Stages 1 to 3 again with the open choices taken in order, the head, the tiles and offload, until one is
        predicted to fit (or, `first`, with the first that is still open); None where none was open or made a plan.
        Each is planned for the bytes the budget resolved to with the model's own head (`own`'s: NOTE [ The head
        as a choice ], rule 1); `last` is the plan so far, which a choice the profile does not see keeps. A head
        put back as no better alone is tried again on top of the next choice taken (implementation note 5 there)."""
        solved = self._with_head(head, step, blocks, regime, own) if head.open else None
        if first and solved is not None:
            return solved
        for extra in extras:
            if (solved is None or not solved.fits) and extra.open:
                solved = self._with(extra, step, blocks, regime, own.budget, solved or last) or solved
                if first and solved is not None:
                    return solved
                # open again even where this fits: a real step that refuses it takes the head next (`first`)
                if solved is not None and head.reopen() and not solved.fits:
                    solved = self._with_head(head, step, blocks, regime, own, than=solved) or solved
        return solved

    def _solved(self, step: TrainingStep, blocks: Sequence[nn.Module], regime: BudgetRegime,
                budget: int | float) -> Solved:
        """Stages 1 to 3 on `step`'s model: the profile of every block under every choice (NOTE [ Profiling rounds ]
        in profile.py), their costs, and the fastest assignment predicted to fit `budget`; where none is, the one
        that holds least. Rank 0's on every rank (NOTE [ The same plan on every rank ] in verify.py)."""
        model = step.model
        found = profile(self.names, blocks, self.choices.labels, step,
                        lambda i, c: self.choices.assign(model, i, c), derived=self.choices.derived(),
                        compiled=regime.compiled, fake=regime.profiles_on_fake(model), twin=regime.twin,
                        gradients_kept=regime.gradients_kept)
        measured = measured_costs(found)
        cost = regime.with_gradients(model, blocks, measured, found)
        try:
            assignment, fits = solve_budget(cost, budget), True
        except BudgetError:
            assignment, fits = least_assignment(cost, budget), False
        return Solved(measured, cost, from_rank_zero(assignment), fits)

    def _with_head(self, head: HeadChoice, step: TrainingStep, blocks: Sequence[nn.Module], regime: BudgetRegime,
                   own: Solved, than: Solved | None = None) -> Solved | None:
        """Stages 1 to 3 again with the model's head routed, for the bytes the budget resolved to with the model's
        own head (`own`'s: NOTE [ The head as a choice ], rule 1); None, the head put back, where that is no plan
        or no better a plan than `than` (`own` unless given: implementation note 2)."""
        head.route()
        try:
            routed: Solved | None = self._solved(step, blocks, regime, own.budget)
        except Exception:
            routed = None
        if routed is None or not head.ran() or (
                not routed.fits and routed.assignment.peak_bytes >= (than or own).assignment.peak_bytes):
            head.take_back()
            return None
        return routed

    def _with(self, extra: Extra, step: TrainingStep, blocks: Sequence[nn.Module], regime: BudgetRegime,
              budget: int, last: Solved) -> Solved | None:
        """Stages 1 to 3 again with `extra` taken (the tiles, offload), for `budget`; `last` where its profile would
        not see it (offload: NOTE [ Offload as a choice ], rule 2); None, `extra` taken back, where it changed
        nothing (no block has a token-wise module) or that is no plan (NOTE [ Tiles as a choice ])."""
        if not extra.take():
            return None
        if not extra.profiled:
            return last
        try:
            return self._solved(step, blocks, regime, budget)
        except Exception:
            extra.take_back()
            return None

    def _verified(self, step: TrainingStep, regime: BudgetRegime, solved: Solved) -> Assignment:
        """Stage 4: `solved`'s assignment on the blocks of `step`'s model, verified on real steps now, or on the
        model's first training step where its prediction fits and the regime allows it (NOTE [ Verifying the plan ]
        in verify.py)."""
        model = step.model
        self.choices.calls = solved.assignment.cost.calls  # rank 0's calls too
        self.choices.place(model, solved.assignment)
        if (solved.fits or not regime.real_steps) and regime.verifies_later():  # NOTE [ The first step ]
            self.verification = Verification(solved.assignment)
            return solved.assignment
        return regime.verify(solved.assignment,  # NOTE [ Verifying the plan ]; in `fit`'s `step.planning()`
                           lambda a: regime.measure(step, solved.measured, solved.cost, a),
                           lambda a: self.choices.place(model, a))

    # -- at every forward ------------------------------------------------------------------------------------------

    def __call__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.sharded and not self.warned and self._now_sharded(model):
            self.warned = True
            warnings.warn(SHARDED_LATER.format(model=type(model).__name__), UserWarning, stacklevel=2)
        if compiling():  # the model's root is traced: compiled as one graph (NOTE [ Compiled as one graph ])
            if not self.regime.compiled and model.training and torch.is_grad_enabled():
                when_traced(warn_one_graph)
            return
        if self.busy:
            return
        self.settle(model)
        if not model.training or not torch.is_grad_enabled():
            return
        if self.request.replan and (now := signature(args, kwargs)) != self.signature:
            if not self.told:
                self.told = True
                shapes = self.signature is None or [s and s[0] for s in now] != [s and s[0] for s in self.signature]
                _log.warning(
                    "remat: the budgeted %s was called with %s: profiling one training step and planning again "
                    "inside this forward (it will do so for every new shape, dtype or device of its inputs; pass "
                    "`replan=False` to remat.apply to keep the first plan). Logged once per model.",
                    type(model).__name__, "new input shapes" if shapes else "inputs of a new dtype or device",
                )
            self.fit(model, args, kwargs)
        elif self.assignment is not None and StepAutocast.caller(self.devices) != self.autocast:
            self.autocast_changed(model, args, kwargs)
        elif self.assignment is not None and (engine := engine_of(model)) != self.engine:
            self.engine_changed(model, engine, args, kwargs)
        if self.verification is not None and self.step is None and can_track():  # NOTE [ The first step ]
            engine = engine_of(model)  # its own buffers set apart: NOTE [ Set apart ] in step_tracker.py
            self.step = FirstStep(model, self.seen, None if engine is None else engine.allocating)

    def autocast_changed(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A training forward under other autocast settings than the plan's: NOTE [ Planned under autocast ]."""
        now = StepAutocast.caller(self.devices)
        planned, training = str(self.autocast or "without autocast"), str(now or "without autocast")
        if not self.request.replan:
            if not self.told_autocast:
                self.told_autocast = True
                warnings.warn(KEPT_UNDER_AUTOCAST.format(model=type(model).__name__, planned=planned,
                                                         training=training), UserWarning, stacklevel=3)
            return
        _log.warning("remat: the budgeted %s was planned %s and trains %s: planning again for this step.",
                     type(model).__name__, planned, training)
        self.fit(model, args, kwargs)

    def engine_changed(self, model: nn.Module, engine: DeepSpeed | None, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> None:
        """A training forward of a model an engine owns now and did not when planned, or the other way round
        (`remat.apply` before `deepspeed.initialize`): NOTE [ Budgets under DeepSpeed ZeRO ], rule 5."""
        now = "under " + engine.name if engine is not None else "without an engine"
        planned = "under " + self.engine.name if self.engine is not None else "without an engine"
        if not self.request.replan:
            if not self.told_engine:
                self.told_engine = True
                _log.warning("remat: the budgeted %s was planned %s and trains %s; with replan=False the plan is "
                             "kept (its first training step checks it).", type(model).__name__, planned, now)
            self.engine = engine
            return
        _log.warning("remat: the budgeted %s was planned %s and trains %s: planning again for this step, on fake "
                     "tensors.", type(model).__name__, planned, now)
        self.fit(model, args, kwargs)

    def seen(self, peak: int) -> None:
        """A tracked step's backward ended: its peak shows in `remat.plan(model)` at once (this rank's), and what it
        set apart as an engine's is said once (NOTE [ Budgets under DeepSpeed ZeRO ], rule 3)."""
        if self.assignment is not None:
            self.assignment = dataclasses.replace(self.assignment, measured=peak)
        step = self.step
        if step is not None and step.set_apart and not self.told_apart:
            self.told_apart = True
            _log.warning(
                "remat: the first training step of the budgeted %s set apart %s that %s allocated for itself "
                "(gradient buckets and partitions, gathered parameters), as the optimizer's state is; the budget "
                "bounds the rest: %s of activations and gradients at the step's peak.", step.model_name,
                format_bytes(step.set_apart), self.engine.name if self.engine is not None else "its engine",
                format_bytes(peak))

    def settle(self, model: nn.Module) -> None:
        """At a forward: pop what tracked steps left, and act on a tracked step's peak (NOTE [ The first step ])."""
        tidy()
        step, verification = self.step, self.verification
        if step is None or verification is None:
            return
        if step.dropped:  # a forward alone, its graph gone: the next training forward starts a step
            self.close()
            return
        if step.peak is None:  # no backward through the outputs yet: the step goes on
            step.forwards += 1
            if step.forwards > WINDOW:
                _log.info("remat: no backward through %s's outputs in %d forwards; its plan stays unverified.",
                          type(model).__name__, WINDOW)
                self.verification = None
                self.close()
            return
        self.close()
        try:
            following = verification.after(max_over_ranks(step.peak))
        except BudgetError as e:  # the least choice is on the blocks: training goes on with it
            following = None
            warnings.warn(f"{e} Training goes on with that choice.", UserWarning, stacklevel=4)
        self.assignment = verification.assignment
        if following is None:
            self.verification = None
        else:
            self.choices.place(model, following)

    def close(self) -> None:
        """Stop tracking a step (its mode is popped now or at a later forward)."""
        step, self.step = self.step, None
        if step is not None:
            step.close()

    def _now_sharded(self, model: nn.Module) -> bool:
        """Whether ``fully_shard`` was applied to the model or a block since the plan (the root and the blocks
        are checked, not every module: this runs on every forward)."""
        names = (model.get_submodule(name) for name in self.names)  # looked up only once FSDP is imported
        return _sharded.is_sharded_any(itertools.chain((model,), names))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "busy": False, "step": None}


# NOTE [ Planned under autocast ]
# 1. A plan is made for the autocast settings its steps ran under (the caller's, when `remat.apply` or the
#    re-planning forward ran): autocast changes what a step holds (weight casts cached for the region, NOTE [ A step's
#    own autocast region ] in remat/_measure/step_autocast.py, and activations in the lower precision).
# 2. A training forward under other settings plans again there, before the forward goes on, with one log line; a
#    fractional budget is then of that step's peak without remat.
# 3. With `replan=False` the plan is kept and a warning says once that its budget holds for the settings it was made
#    under.
KEPT_UNDER_AUTOCAST = (
    "remat: the budget of `{model}` was planned {planned} and trains {training}, which holds other bytes (casts of "
    "the weights, activations in another precision); with replan=False the plan is kept and its budget holds for "
    "the settings it was made under. Call remat.apply under the training step's autocast, or pass replan=True."
)


def _holds_fakes(model: nn.Module) -> bool:
    """Whether the model's parameters are fake tensors (`remat.estimate`'s budget rows)."""
    return any(isinstance(p, FakeTensor) for p in itertools.islice(model.parameters(), 1))


def _no_meta(model: nn.Module) -> None:
    """A budget is planned on a real step: refuse a model whose weights are on the meta device (no bytes to
    count, so every plan would look free). Fake tensors (the estimator's) report the device they stand for."""
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if tensor.device.type == "meta":
            raise ValueError(
                f"remat: apply with a `budget` profiles one real training step, but {type(model).__name__}'s "
                f"`{name}` is on the meta device, where no memory is counted. Materialise the model first "
                "(`model.to_empty(device=...)` and initialise it), or use `remat.estimate(model, sample, ...)`, "
                "which takes a meta model."
            )
