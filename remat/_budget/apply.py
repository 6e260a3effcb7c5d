"""`remat.apply(model, budget=..., sample=...)`: choose per block how it is rematerialized so a step fits a budget.

See NOTE [ Budgeted models ] and the docs' guide "Fit a memory budget".

NOTE [ Budgeted models ]
A `_Budget` forward pre-hook on the model holds what the budget needs: the blocks (by qualified name, so that
`deepcopy` and pickling keep pointing at the copy's own blocks), the choices, the loss, the options, and the
plan for the last input signature (shapes, dtypes, devices of the tensors among the inputs). Each block's
choice is put on it with the same hooks `remat(module)` uses (none for "kept"), so `remat.plan`, `remat.undo`,
`state_dict` (no key changes) and `deepcopy` treat a budgeted model like any other. When the model is called in
training with gradients on and a new input signature (and `replan=True`), the hook profiles one step on
(detached copies of) those inputs and re-plans before the forward goes on; the profile's own calls of the
model pass through the hook untouched. A plan is checked on a real tracked step: the model's first training step
with it (NOTE [ The first step ] in remat/_budget/first_step.py), or one more step of the sample before the plan is
returned where that cannot stand in (NOTE [ Checking the plan ] in remat/_budget/check.py). A failed re-plan
(BudgetError) puts the previous choices back.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from .._core.errors import BudgetError
from .._core.options import Options, Strategy
from .._core.policies import Policy, PolicyLike, as_policy, matmuls, save_matmuls
from .._core.torch_compat import eager_for_now, when_traced
from .._core.units import Budget, parse_budget
from .._engine.compiled import compiling, in_compiled_call
from .._measure import sharded as _sharded
from .._measure.autocast import StepAutocast, planning, step_region
from .._measure.loss import default_loss
from .._measure.sample import as_call, detached, signature
from .._measure.step_peak import compiled_peak, measure_step
from .._measure.track import placed as placed_on
from .._sites.targets import Where, remove_hooks, select, wrap_module
from .check import AssignmentCheck, check_assignment, check_measured
from .costs import ModelCost, with_gradients
from .derive import DERIVABLE, PARTS
from .fake_profile import on_fake, profile_fake
from .first_step import WINDOW, FirstStep, can_track, tidy
from .gradients import accumulation_order, gradient_steps
from .head import fit_choosing_head
from .profile import profile_blocks
from .ranks import from_rank_zero, max_over_ranks
from .solve import Assignment, least_assignment, resolve_budget, solve_budget
from .whole_graph import gradient_bytes, graph_extra, warn_one_graph, with_graph_gradients

__all__ = ["apply_budget"]

_M = TypeVar("_M", bound=nn.Module)
Loss = Callable[[Any], torch.Tensor]
_KEPT = "kept"
_log = logging.getLogger("remat")


def _label(policy: PolicyLike, taken: set[str]) -> str:
    label = repr(as_policy(policy))
    while label in taken:
        label += "'"
    return label


class _Budget:
    """The model's forward pre-hook that holds its budget plan and re-plans on a new input signature."""

    _remat_owned = True  # `remat.undo` removes it (see `_targets._is_ours`)
    # What a hook pickled before it had these attributes reads (the instance's own values shadow them):
    compile = grads = told = upfront = told_autocast = False
    check: AssignmentCheck | None = None
    step: FirstStep | None = None
    sharded = warned = True  # no warning about `fully_shard` for a plan of unknown origin
    calls: tuple[tuple[frozenset[int] | None, ...], ...] = ()
    autocast: StepAutocast | None = None
    devices: tuple[torch.device, ...] = ()

    def __init__(
        self,
        budget: int | float,
        names: tuple[str, ...],
        policies: tuple[PolicyLike | str, ...],
        labels: tuple[str, ...],
        loss: Loss | None,
        replan: bool,
        options: dict[str, Any],
        compile: bool = False,
        grads: bool = False,
        upfront: bool = False,
    ) -> None:
        self.budget = budget
        self.head: bool | None = None  # apply's `head`: NOTE [ The head as a choice ] in head.py
        self.resolved: int | None = None  # the budget in bytes on the last profile (the same NOTE)
        self.names = names
        self.policies = policies
        self.labels = labels
        self.loss = loss
        self.replan = replan
        self.options = options
        self.compile = compile  # plan for one compiled graph: NOTE [ Compiled as one graph ]
        self.assignment: Assignment | None = None
        self.signature: tuple[Any, ...] | None = None
        self.busy = False
        self.told = False  # whether re-planning inside a forward was logged (once per model)
        self.sharded = False  # whether the plan was made on a `fully_shard`-ed model: NOTE [ Budgets and FSDP2 ]
        self.warned = False
        self.grads = grads  # whether the checked step counts new gradients (`memory=`: NOTE [ Total memory ])
        self.calls = ()  # the parts' calls: NOTE [ Some matmuls ]
        self.upfront = upfront  # check every plan before it is kept, never on a training step (the estimator)
        self.check: AssignmentCheck | None = None  # waiting for training steps: NOTE [ The first step ]
        self.step: FirstStep | None = None  # the training step being tracked for it
        self.autocast: StepAutocast | None = None  # what the plan's steps ran under: NOTE [ Planned under autocast ]
        self.devices: tuple[torch.device, ...] = ()  # where the model was when planned (its autocast types)

    def assign(self, model: nn.Module, i: int, c: int) -> None:
        block = model.get_submodule(self.names[i])
        remove_hooks(block)
        policy = self.policies[c]
        if self.labels[c] in PARTS:  # derived, never run while profiling: NOTE [ Some matmuls ]
            calls = self.calls[i][c] if self.calls else None
            if calls is None:
                raise ValueError(f"remat: choice {self.labels[c]!r} is not open to block {self.names[i]!r}.")
            policy = Policy(ops=(matmuls,), calls=calls)
        if policy != _KEPT:
            wrap_module(block, Options(policy=policy, **self.options), model)  # type: ignore[arg-type]

    def place(self, model: nn.Module, plan: Assignment) -> None:
        """Put `plan`'s choices on the blocks."""
        for i, c in enumerate(plan.choice):
            self.assign(model, i, c)

    def fit(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Assignment:
        """Plan for these inputs: `fit_blocks`, with the head routed where only that fits (NOTE [ The head as a
        choice ] in head.py)."""
        return fit_choosing_head(self, model, args, kwargs)

    def fit_blocks(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Assignment:
        """Profile one step on these inputs, solve, and put the chosen options on the blocks."""
        args, kwargs = detached(args), detached(kwargs)
        loss = self.loss or default_loss
        blocks = [model.get_submodule(name) for name in self.names]
        previous, previous_calls = self.assignment, self.calls
        devices = placed_on(model)
        autocast = StepAutocast.caller(devices)  # NOTE [ A step's own autocast region ]

        def step_on(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., torch.Tensor]:
            def step(run: nn.Module = model) -> torch.Tensor:
                with step_region(autocast):
                    out = loss(run(*args, **kwargs))
                if not isinstance(out, torch.Tensor) or out.numel() != 1:
                    raise TypeError(
                        f"remat: `loss` must return a scalar tensor, but it returned {type(out).__name__}"
                        f"{'' if not isinstance(out, torch.Tensor) else f' of shape {tuple(out.shape)}'}."
                    )
                return out

            return step

        step = step_on(args, kwargs)

        self.busy = True
        restore = None if in_compiled_call() else eager_for_now()  # compiled blocks: NOTE [ The first step ]
        try:
            with torch.enable_grad(), planning(autocast, devices):
                rerun = self.options["strategy"] == "rerun"  # NOTE [ Deriving choices ]: rerun's recompute
                derived = [c for c, label in enumerate(self.labels) if rerun and label in DERIVABLE]

                def profile(run: Callable[[], torch.Tensor]) -> ModelCost:  # NOTE [ Gradients in the budget ]
                    with accumulation_order(model) as order:
                        found = profile_blocks(
                            model, self.names, blocks, self.labels, run, lambda i, c: self.assign(model, i, c),
                            derived, compiled=self.compile,
                        )
                    if self.compile:  # one graph's backward: NOTE [ Compiled as one graph ]
                        return found
                    return with_gradients(found, gradient_steps(blocks, order))

                fake = on_fake(model, self.compile, self.options["strategy"])  # NOTE [ Planning on fake tensors ]
                cost = profile_fake(model, args, kwargs, step_on, profile) if fake else None
                if cost is None:
                    cost = profile(step)
            eager = cost
            if self.compile:
                cost = with_graph_gradients(cost, *gradient_bytes(model, blocks))
            self.check = None
            self.close()
            fits = True
            self.resolved = resolve_budget(self.budget, cost)  # NOTE [ The head as a choice ] in head.py
            try:
                plan = solve_budget(cost, self.budget)
            except BudgetError:  # checked on a real step before it is refused: NOTE [ Checking the plan ]
                plan, fits = least_assignment(cost, self.budget), False
            plan = from_rank_zero(plan)  # NOTE [ The same plan on every rank ]
            self.calls = plan.cost.calls  # rank 0's calls too
            self.place(model, plan)
            placed = [plan.choice]

            def assign(p: Assignment) -> None:
                self.place(model, p)
                placed[0] = p.choice

            def measure() -> int:
                if self.grads:  # from no gradients, eager code keeps each one as a one-graph backward does
                    return max_over_ranks(measure_step(model, step))
                if self.compile:  # NOTE [ Measuring a compiled step ]
                    peak = compiled_peak(model, step)
                    if peak is not None:
                        return max_over_ranks(peak)
                measured = max_over_ranks(measure_step(model, step, grads=not self.compile))
                if self.compile:  # an eager step, lifted to one compiled graph: NOTE [ Compiled as one graph ]
                    measured += graph_extra(eager, cost, placed[0])
                return measured

            if fits and not (self.upfront or self.grads or self.compile or _sharded.is_sharded(model)):
                self.check = AssignmentCheck(plan)  # on the first training step: NOTE [ The first step ]
            else:
                with torch.enable_grad(), planning(autocast, devices):  # NOTE [ Planned on measured steps ]
                    plan = (check_measured if self.compile else check_assignment)(plan, measure, assign)
        except BaseException:
            self.calls = previous_calls
            for i in range(len(blocks)):  # back to the previous choices, or to none
                if previous is None:
                    remove_hooks(blocks[i])
                else:
                    self.assign(model, i, previous.choice[i])
            raise
        finally:
            self.busy = False
            if restore is not None:
                restore()
        self.assignment = plan
        self.autocast, self.devices = autocast, devices
        self.signature = signature(args, kwargs)
        self.sharded = _sharded.is_sharded(model)
        return plan

    def __call__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.sharded and not self.warned and self._now_sharded(model):
            self.warned = True
            warnings.warn(SHARDED_LATER.format(model=type(model).__name__), UserWarning, stacklevel=2)
        if compiling():  # the model's root is traced: compiled as one graph (NOTE [ Compiled as one graph ])
            if not self.compile and model.training and torch.is_grad_enabled():
                when_traced(warn_one_graph)
            return
        if self.busy:
            return
        self.settle(model)
        if not model.training or not torch.is_grad_enabled():
            return
        if self.replan and signature(args, kwargs) != self.signature:
            if not self.told:
                self.told = True
                _log.warning(
                    "remat: the budgeted %s was called with new input shapes: profiling one training step and "
                    "planning again inside this forward (it will do so for every new shape; pass `replan=False` "
                    "to remat.apply to keep the first plan). Logged once per model.", type(model).__name__,
                )
            self.fit(model, args, kwargs)
        elif self.assignment is not None and StepAutocast.caller(self.devices) != self.autocast:
            self.autocast_changed(model, args, kwargs)
        if self.check is not None and self.step is None and can_track():  # NOTE [ The first step ]
            self.step = FirstStep(model, self.seen)

    def autocast_changed(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A training forward under other autocast settings than the plan's: NOTE [ Planned under autocast ]."""
        now = StepAutocast.caller(self.devices)
        planned, training = str(self.autocast or "without autocast"), str(now or "without autocast")
        if not self.replan:
            if not self.told_autocast:
                self.told_autocast = True
                warnings.warn(KEPT_UNDER_AUTOCAST.format(model=type(model).__name__, planned=planned,
                                                         training=training), UserWarning, stacklevel=3)
            return
        _log.warning("remat: the budgeted %s was planned %s and trains %s: planning again for this step.",
                     type(model).__name__, planned, training)
        self.fit(model, args, kwargs)

    def seen(self, peak: int) -> None:
        """A tracked step's backward ended: its peak shows in `remat.plan(model)` at once (this rank's)."""
        if self.assignment is not None:
            self.assignment = dataclasses.replace(self.assignment, measured=peak)

    def settle(self, model: nn.Module) -> None:
        """At a forward: pop what tracked steps left, and act on a tracked step's peak (NOTE [ The first step ])."""
        tidy()
        step, check = self.step, self.check
        if step is None or check is None:
            return
        if step.dropped:  # a forward alone, its graph gone: the next training forward starts a step
            self.close()
            return
        if step.peak is None:  # no backward through the outputs yet: the step goes on
            step.forwards += 1
            if step.forwards > WINDOW:
                _log.info("remat: no backward through %s's outputs in %d forwards; its plan stays unchecked.",
                          type(model).__name__, WINDOW)
                self.check = None
                self.close()
            return
        self.close()
        measured = max_over_ranks(step.peak)
        try:
            following = check.after(measured)
        except BudgetError as e:  # the least choice is on the blocks: training goes on with it
            following = None
            warnings.warn(f"{e} Training goes on with that choice.", UserWarning, stacklevel=4)
        self.assignment = check.plan
        if following is None:
            self.check = None
        else:
            self.place(model, following)

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
# Autocast changes what a step holds: casts of the weights (cached for the region: NOTE [ A step's own autocast
# region ] in remat/_measure/autocast.py) and activations in the lower precision. So a plan is made for the
# autocast settings its steps ran under (the caller's, when `remat.apply` or the re-planning forward ran), and a
# training forward under other settings (a budget planned outside `torch.autocast` and trained inside it, the
# common case) plans again there, before the forward goes on, with one log line; the fraction of a fractional
# budget is then of that step's peak without remat. With `replan=False` the plan is kept and a warning says once
# that its budget holds for the settings it was made under.
KEPT_UNDER_AUTOCAST = (
    "remat: the budget of `{model}` was planned {planned} and trains {training}, which holds other bytes (casts of "
    "the weights, activations in another precision); with replan=False the plan is kept and its budget holds for "
    "the settings it was made under. Call remat.apply under the training step's autocast, or pass replan=True."
)


# NOTE [ Budgets and FSDP2 ]
# A budget bounds what forward and backward allocate on top of what lives before the step. Planned on an
# unsharded model, that is the activations and the whole gradients; once `fully_shard` is applied, one rank's
# step allocates differently: gradients at their shard's size, but each block's parameters all-gathered for its
# forward and again for its backward, the root's kept unsharded throughout, and each block's whole gradients
# until they are reduce-scattered. Neither the sign nor the size of the difference follows from the unsharded
# step (tests/budget/test_sharded_budget.py: a plan made unsharded went over in the sharded step, one made after
# `fully_shard` for the same bytes did not; docs/benchmarks.md), and re-planning inside the sharded root's forward
# would nest a step in FSDP's own. So the plan is
# kept, and the first forward after sharding warns once, asking for `remat.apply(model, budget=...)` after
# `fully_shard`, which plans on the rank's own step. DDP needs nothing: its buckets exist before the step and
# its gradients are the plain step's (or views into the buckets).
SHARDED_LATER = (
    "remat: the budget of `{model}` was planned by remat.apply(model, budget=...) before `fully_shard`, on the "
    "unsharded step; one rank's sharded step allocates differently (parameters all-gathered per block, gradients "
    "sharded), so the budget does not hold per rank. Call remat.apply(model, budget=..., sample=...) after "
    "`fully_shard` (on every rank) to plan on this rank's step."
)


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


def apply_budget(
    model: _M,
    budget: Budget,
    sample: Any,
    where: Where | None,
    *,
    loss: Loss | None,
    choices: Sequence[PolicyLike] | None,
    replan: bool,
    preserve_rng: bool,
    strategy: Strategy,
    check: bool,
    grads: bool = False,
    compile: bool = False,
    upfront: bool = False,
    head: bool | None = None,
) -> _M:
    """See `remat.apply`: profile, solve, and keep re-planning on new input shapes (NOTE [ Budgeted models ])."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"remat: apply expects an nn.Module, but got `{type(model).__name__}`.")
    value = parse_budget(budget)
    if sample is None:
        raise ValueError(
            "remat: apply with a `budget` needs `sample=`: the model's inputs for one training step (a tensor, "
            "a tuple of positional arguments, or a dict of keyword arguments), to profile the blocks on."
        )
    if loss is not None and not callable(loss):
        raise TypeError(f"remat: `loss` must be a callable from the output to a scalar, but got {loss!r}.")
    for flag, given in (("replan", replan), ("compile", compile)):
        if not isinstance(given, bool):
            raise TypeError(f"remat: `{flag}` must be a bool, but got `{type(given).__name__}`.")
    _no_meta(model)
    policies: list[PolicyLike | str] = [_KEPT]
    labels = [_KEPT]
    if strategy == "rerun":
        policies.append(save_matmuls)
        labels.append("save_matmuls")
    policies.append(None)
    labels.append("full")
    for extra in choices or ():
        as_policy(extra)  # a TypeError for anything else
        if strategy != "rerun":
            raise ValueError("remat: `choices` (policies) work with strategy='rerun' only; leave out `strategy`.")
        labels.append(_label(extra, set(labels) | set(PARTS)))
        policies.append(extra)
    if strategy == "rerun" and not compile:  # eager code only: NOTE [ Some calls ] in remat/_core/policies.py
        policies.extend(PARTS)  # their policies are made per block once profiled: NOTE [ Some matmuls ]
        labels.extend(PARTS)
    blocks = select(model, where)
    names = tuple(name for name, _ in blocks)
    options = {"preserve_rng": preserve_rng, "strategy": strategy, "check": check}
    Options(**options)  # type: ignore[arg-type]  # validates before any hook is placed
    for _, block in blocks:
        remove_hooks(block)
    for key, hook in list(model._forward_pre_hooks.items()):
        if isinstance(hook, _Budget):
            hook.close()
            del model._forward_pre_hooks[key]
            model._forward_pre_hooks_with_kwargs.pop(key, None)
    hook = _Budget(value, names, tuple(policies), tuple(labels), loss, replan, options, compile, grads, upfront)
    hook.head = head  # NOTE [ The head as a choice ] in head.py
    args, kwargs = as_call(sample)
    hook.fit(model, args, kwargs)
    model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    return model
