"""Run one training step on fake tensors per configuration and count its bytes: the core of `remat.estimate`.

NOTE [ What an estimate runs ]
Rules:
1. An estimate predicts a steady-state training step, the one that repeats: at its start the model's parameters
   and buffers, the optimizer's state and the batch are alive, and the gradients are not
   (``zero_grad(set_to_none=True)``, torch's default, ended the previous step).
2. The step is a default loop's ``loss = loss_fn(model(batch)); loss.backward(); optimizer.step();
   optimizer.zero_grad()``: forward, the loss, the model's output let go of once the loss is made
   (``model(batch).loss`` keeps no reference to it), backward, the optimizer step and ``zero_grad``; the loss is
   dropped before the optimizer step. What of the output backward needs stays alive through autograd; the rest (a
   language model's logits, typically) is freed before backward, and its bytes are the row's ``output_bytes``, what
   a loop that holds on to the output needs at most in addition.
3. Under the caller's ``torch.autocast``, the forward and the loss run in an autocast region of their own with the
   caller's settings, backward and the optimizer step outside it, as in torch's AMP recipe (NOTE [ A step's own
   autocast region ] in remat/_measure/step_autocast.py): each configuration casts the weights afresh, and no
   prediction depends on which others run in the same call.
4. The budget planner profiles and checks the same step (``loss(model(sample))``: NOTE [ Budgeted models ] in
   remat/_budget/driver.py), so ``memory=`` and the largest batch that fits mean the step of the estimate's rows.
5. Each configuration runs the same step with its own remat sites, on fake tensors (NOTE [ Counting fake
   tensors ]): the bytes are those of the tensors the same ops would make on the device predicted for, nothing is
   allocated at the model's size, and what a configuration frees and rebuilds in backward is counted, not
   modelled.

Implementation notes:
1. (rule 1) The optimizer's state is made by one step on zero gradients before the counted step (optimizers create
   it lazily), so it is alive throughout the counted one, as from the second step of a real run on.

NOTE [ The optimizer the device runs ]
1. A fake step runs the optimizer implementation the real step on the predicted device would: torch's rule
   (``_default_to_fused_or_foreach`` in torch/optim/optimizer.py) applied to the real parameters' Python types and
   the device predicted for, written into each param group as torch reads it (``group["foreach"]``, with torch's
   exception: a tensor ``lr`` without ``capturable``).
2. An explicit ``foreach=`` or ``fused=`` is honoured as given.

Implementation notes:
1. (rule 1) Left to choose (``foreach=None``, ``fused=None``) torch picks ``foreach`` when every parameter is exactly
   a tensor, a ``Parameter`` or a ``DTensor`` on a device with foreach kernels (CUDA, XPU, MTIA, PrivateUse1),
   else the for-loop; the two hold different temporaries at their peak (AdamW's foreach step: one parameter-sized
   ``_foreach_sqrt`` more). A ``FakeTensor`` fails that type check, so a fake step left to choose would take the
   for-loop where the GPU takes foreach.

NOTE [ One optimizer step ]
1. The optimizer step runs, counted by a tracker of its own, once, under the first configuration.
2. Each configuration's peak is the larger of its forward/backward peak and what is alive when its optimizer step
   would start plus the bytes the step adds at its peak.

Implementation notes:
1. (rules 1, 2) The step does the same ops on the same parameters, gradients and state under every configuration;
   only what else is alive when it starts differs. So rule 2 gives the number a second run would, at a fraction of
   the time (a 7B model's AdamW step is thousands of fake ops).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._core.errors import BudgetError, RematError
from .._core.torch_compat import foreach_by_default
from .._engine.once import counted_once
from .._measure.fake import (
    FakeTracker,
    data_dependent,
    fake_mode,
    fake_sample,
    fake_state,
    note_fake_step,
    run_on,
    stand_in,
    storage_bytes,
    tensors_of,
)
from .._measure.hf_fake import real_masks
from .._measure.loss import call_model as call_loss
from .._measure.loss import default_loss
from .._measure.step_autocast import StepAutocast, planning, step_region
from .constants import first_step_bytes
from .depth import Layers, identical_layers
from .phases import BACKWARD, FORWARD, OPTIMIZER, PhaseTracker, where_it_peaks
from .report import ConfigEstimate, EstimateReport
from .workers import in_workers

if TYPE_CHECKING:
    from .._sites.integrations.deepspeed import DeepSpeed, RankState

__all__ = ["OPTIMIZERS", "Configured", "OptimizerLike", "Refine", "Rerun", "make_optimizer", "predict"]

OptimizerLike = str | Callable[..., torch.optim.Optimizer] | None

# The optimizers named by a string, with the settings they run with (torch's defaults, and momentum for SGD, so
# that it keeps the state SGD is usually run with).
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {}),
}


@dataclass(frozen=True)
class Configured:
    """A configuration to estimate: as given, as labelled, and how to apply it to the model for a while.

    ``apply(sample)`` returns a context manager that sets the configuration's remat sites on the model (given
    the fake sample, for a planner that profiles) and restores the model as it was on exit.
    """

    config: Any
    label: str
    apply: Callable[[Any], AbstractContextManager[Any]]
    alike: bool = True
    """Whether the configuration runs every block alike (a budget's plan chooses per block)."""


def make_optimizer(optimizer: OptimizerLike, params: Sequence[torch.Tensor], device: torch.device,
                   kinds: Collection[type] = ()) -> torch.optim.Optimizer | None:
    """The optimizer over the trainable ``params``: a name of `OPTIMIZERS`, a class or factory, or None; it runs
    the implementation the real one would run (NOTE [ The optimizer the device runs ]).

    ``kinds`` are the Python types of the real parameters the fake ``params`` stand for (plain `Parameter`s when
    not given).
    """
    if optimizer is None:
        return None
    trainable = [p for p in params if p.requires_grad]
    made: Any
    if isinstance(optimizer, str):
        kind, settings = OPTIMIZERS[optimizer.lower()]
        made = kind(trainable, **settings)
    else:
        made = optimizer(trainable)
    if not isinstance(made, torch.optim.Optimizer):
        raise TypeError(
            f"remat: estimate's `optimizer` must make a torch.optim.Optimizer from the parameters, but it made "
            f"`{type(made).__name__}`."
        )
    foreach = foreach_by_default(kinds or (nn.Parameter,), device.type)
    for group in made.param_groups:
        if "foreach" not in group or group["foreach"] is not None or group.get("fused") or group.get(
                "differentiable"):
            continue  # an optimizer without the choice, or one made explicit: as it is
        lr = group.get("lr")
        group["foreach"] = foreach and not (isinstance(lr, torch.Tensor) and not group.get("capturable"))
    return made


def _state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [t for state in optimizer.state.values() for t in tensors_of(state)]


def _scalar(out: Any, loss: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    value: Any
    value = loss(out) if loss is not None else default_loss(out)
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
        raise ValueError(
            "remat: estimate needs a loss that is a one-element tensor requiring grad, but got "
            f"`{type(value).__name__}`; pass `loss=` a callable from the model's output to the scalar loss."
        )
    return value


def _warm(optimizer: torch.optim.Optimizer | None, params: Sequence[torch.Tensor]) -> None:
    """One step on zero gradients, so that the optimizer makes its state (see NOTE [ What an estimate runs ])."""
    if optimizer is None:
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _step(model: nn.Module, sample: Any, loss: Callable[[Any], torch.Tensor] | None,
          optimizer: torch.optim.Optimizer | None, params: Sequence[torch.Tensor],
          device: torch.device, step_bytes: list[int], autocast: StepAutocast | None = None,
          layers: nn.Module | None = None) -> tuple[int, int, int, int, PhaseTracker]:
    """Run one counted step; return (gradient bytes, activation bytes, the output's bytes freed when it is let go
    of, peak bytes the step adds on ``device``, the tracker with the forward and backward peaks and their holders:
    NOTE [ Who holds the peak ]).

    ``step_bytes`` holds what the optimizer step adds at its peak once it has been counted (see NOTE [ One
    optimizer step ]); it is filled by the first call, with the bytes alive when the step starts. The forward and
    the loss run in an autocast region of their own under ``autocast`` (NOTE [ A step's own autocast region ]).
    ``layers``, the container of the model's identical layers, splits backward's peak at them (NOTE [ Who holds
    the peak ], implementation note 2).
    """
    for p in params:
        p.grad = None
    with PhaseTracker(model, device, layers) as tracker, tracker.modules():
        with step_region(autocast):
            out = call_loss(model, sample)
            value = _scalar(out, loss)
        with_output = tracker.current(device)
        del out  # the loop keeps the loss only: NOTE [ What an estimate runs ]
        own = tracker.bytes_of([value]).get(device, 0)
        held = tracker.current(device) - own
        output_bytes = with_output - tracker.current(device)
        tracker.enter(BACKWARD)
        torch.autograd.backward(value)
        grads = [p.grad for p in params if p.grad is not None]
        grad_bytes = storage_bytes(grads)
        del value, grads
        before = tracker.current(device)
        tracker.enter(OPTIMIZER)
        if optimizer is not None:
            if not step_bytes:
                with FakeTracker() as inner:
                    optimizer.step()
                step_bytes.append(inner.peak(device))
            optimizer.zero_grad(set_to_none=True)
    for p in params:
        p.grad = None
    tracker.phase_peaks[OPTIMIZER] = before + sum(step_bytes) if optimizer is not None else 0
    return grad_bytes, held, output_bytes, max(tracker.peak(device), before + sum(step_bytes)), tracker


Refine = Callable[[Configured, ConfigEstimate, "Rerun"], ConfigEstimate]
"""A second look at each configuration (the largest batch): given its row and a `Rerun` that estimates the same
configuration on another sample (real or meta tensors) in the same fake session, return the row to report."""


@dataclass(frozen=True)
class Rerun:
    """How a `Refine` estimates its configuration again, in the same fake session: on another sample, with the whole
    model or with the model cut to its first ``depth`` identical layers (NOTE [ Searching the largest batch ], rule
    5). ``layer_count`` is how many identical layers the model has, None where it has none to cut (or the estimate
    is one rank's, or the configuration is a budget's plan)."""

    steps: _Steps
    configured: Configured
    layer_count: int | None

    def __call__(self, given: Any, depth: int | None = None) -> ConfigEstimate:
        return self.steps.row(self.configured, given, depth)


@dataclass(frozen=True)
class _State:
    """The bytes of a row's state that `predict` counts once: parameters, the optimizer's state and an engine's own
    buffers (one rank's under DeepSpeed ZeRO: NOTE [ One rank's state under DeepSpeed ZeRO ])."""

    params: int
    optimizer: int
    engine: int


@dataclass
class _Steps:
    """What every configuration's step shares in `predict`: the fake model, its optimizer and state, the bytes that
    live throughout (`kept`: parameters, buffers, the optimizer's state, resident tensors) and a first step's
    constants; `row` runs one configuration's step on a sample."""

    model: nn.Module
    loss: Callable[[Any], torch.Tensor] | None
    made: torch.optim.Optimizer | None
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    state: list[torch.Tensor]
    kept: int
    constants: int
    device: torch.device
    run: torch.device
    autocast: StepAutocast | None
    state_bytes: _State
    rank: RankState | None = None
    layers: Layers | None = None
    step_bytes: list[int] = field(default_factory=list)

    def row(self, configured: Configured, given: Any, depth: int | None = None) -> ConfigEstimate:
        """One configuration's row: its step on (a fake copy of) `given`, or the refusal of a budget below what
        remat meets; with `depth`, the step of the model cut to its first `depth` identical layers (`layers`)."""
        args = fake_sample(given, self.run)
        inputs = tensors_of(args)
        constants, rank, state = self.constants, self.rank, self.state_bytes
        base = self.kept + storage_bytes(inputs, self.device) + constants + (0 if rank is None else rank.step)
        given_state = {  # the state's exact bytes, in every row
            "config": configured.config, "label": configured.label, "constant_bytes": constants,
            "params_bytes": state.params, "buffers_bytes": storage_bytes(self.buffers),
            "input_bytes": storage_bytes(inputs), "optimizer_bytes": state.optimizer, "engine_bytes": state.engine,
        }
        gradients = (storage_bytes([p for p in self.params if p.requires_grad]) if rank is None
                     else rank.gradients)
        split = self.layers.container if self.layers is not None and configured.alike else None
        try:
            with configured.apply(args), (self.layers.cut(depth) if self.layers is not None
                                          else contextlib.nullcontext()), counted_once():
                grads, held, output, peak, tracker = _step(
                    self.model, args, self.loss, self.made, self.params, self.device, self.step_bytes, self.autocast,
                    split,
                )
        except BudgetError as error:  # a budget below what remat meets: a row that says so
            return ConfigEstimate(
                **given_state,
                grads_bytes=gradients,
                activation_bytes=0,
                peak_bytes=0,
                refused=str(error),
                least_bytes=error.least_bytes,
            )
        phase, phases, holders = where_it_peaks(tracker, base, self.model, self.params, self.made, self.step_bytes)
        return ConfigEstimate(
            **given_state,
            grads_bytes=grads if rank is None else gradients,
            activation_bytes=held,
            output_bytes=output,
            peak_bytes=base + peak,
            peak_phase=phase,
            phase_bytes=phases,
            holders=holders,
            step_peak_bytes=max(tracker.phase_peaks.get(FORWARD, 0), tracker.phase_peaks.get(BACKWARD, 0)),
            _parts={part: base + n for part, n in tracker.part_peaks.items()},
        )


def _expected_work(configured: Configured) -> tuple[bool, int, bool]:
    """How long a configuration's estimate is likely to take, to sort by (NOTE [ Configurations in workers ], rule 2):
    a budget's plan first, then by its suffixes, then all but "none"."""
    return not configured.alike, configured.label.count("+"), configured.label != "none"


def predict(model: nn.Module, sample: Any, *, loss: Callable[[Any], torch.Tensor] | None,
            optimizer: OptimizerLike, configs: Sequence[Configured], device: torch.device,
            prepare: Callable[[], list[torch.Tensor]] | None = None,
            resident: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
            refine: Refine | None = None, engine: DeepSpeed | None = None, jobs: int = 1) -> EstimateReport:
    """Run the step of NOTE [ What an estimate runs ] on fake tensors once per configuration; count its bytes.

    ``prepare``, if given, runs once the model holds fake parameters (``fully_shard`` for a per-rank estimate)
    and returns the parameters the step trains; ``resident``, if given, makes from them tensors that live
    throughout the step besides the model's and the optimizer's (DDP's gradient buckets), counted in the peak.
    ``refine``, if given, takes a second look at each row (the largest batch that fits). ``engine``, the engine
    that owns the model (DeepSpeed ZeRO), makes it one rank's estimate on the engine's fake twin (NOTE [ One rank's
    state under DeepSpeed ZeRO ] in remat/_sites/integrations/deepspeed.py). ``jobs``: how many forked workers
    run the configurations (NOTE [ Configurations in workers ] in workers.py).
    """
    site = f"`{type(model).__qualname__}`"
    rows: list[ConfigEstimate] = []
    made: torch.optim.Optimizer | None = None
    kinds: set[type] = {type(p) for p in model.parameters()}  # the real ones: NOTE [ The optimizer the device runs ]
    autocast = StepAutocast.caller([device])  # each step in a region of its own: NOTE [ A step's own autocast region ]
    run = run_on(device)  # the CPU standing in for CUDA without a GPU: NOTE [ CUDA without a GPU ] in fake.py
    if run != device and autocast is not None:
        autocast = autocast.moved(device.type, run.type)
    constants = first_step_bytes(device)
    rank: RankState | None = None
    twin: Callable[[nn.Module, torch.device], AbstractContextManager[list[torch.Tensor]]] = fake_state
    if engine is not None:  # only a model DeepSpeed owns loads its integration
        from .._sites.integrations.deepspeed import gradients_taken, rank_state

        rank, twin = rank_state(engine, model), engine.twin  # read before the twin stands in
    masks = real_masks(sample)  # it reads the sample's mask: before the fake mode
    try:
        with stand_in(run, device), planning(autocast, [run]), fake_mode(), twin(model, run) as params, \
                torch.enable_grad(), masks, contextlib.ExitStack() as taken:
            if prepare is not None:
                params = prepare()
                kinds = {type(p) for p in params}  # sharded ones: DTensors, as on the real ranks
            buffers = list(model.buffers())
            made = make_optimizer(optimizer, params, device, kinds)
            _warm(made, params)
            state = _state_tensors(made)
            param_keys = {p.untyped_storage()._cdata for p in params}
            state = [t for t in state if t.untyped_storage()._cdata not in param_keys]
            extra = resident(params) if resident is not None else []
            kept = storage_bytes([*params, *buffers, *state, *extra], device)
            params_bytes, optimizer_bytes, engine_bytes = storage_bytes(params), storage_bytes(state), 0
            if rank is not None:  # one rank's state: NOTE [ One rank's state under DeepSpeed ZeRO ]
                params_bytes, engine_bytes = rank.params, rank.kept + rank.step
                optimizer_bytes = round(storage_bytes(state) * rank.share) + rank.master
                kept = params_bytes + storage_bytes(buffers, device) + optimizer_bytes + rank.kept
                if engine is not None and engine.hands_over:
                    taken.enter_context(gradients_taken(params))
            alone = prepare is None and resident is None and engine is None  # one process's whole model
            layers = identical_layers(model) if refine is not None and alone else None
            steps = _Steps(model, loss, made, params, buffers, state, kept, constants, device, run, autocast,
                           _State(params_bytes, optimizer_bytes, engine_bytes), rank, layers)
            def answer(configured: Configured) -> ConfigEstimate:
                row = steps.row(configured, sample)
                if refine is None:
                    return row
                depth = layers.depth if layers is not None and configured.alike else None
                return refine(configured, row, Rerun(steps, configured, depth))

            # NOTE [ Configurations in workers ] in workers.py, rules 2 and 5
            longest_first = sorted(range(len(configs)), key=lambda i: _expected_work(configs[i]), reverse=True)
            rows = in_workers(configs, answer, jobs if alone else 1, longest_first)
    except RematError:  # a BudgetError raised here is not a configuration's (`apply(memory=)`'s own)
        raise
    except Exception as error:
        translated = data_dependent(error, site)
        if translated is None:
            note_fake_step(error, "remat.estimate", site)
            raise
        raise translated from error
    name = type(made).__name__ if made is not None else None
    return EstimateReport(type(model).__qualname__, str(device), name, tuple(rows))
