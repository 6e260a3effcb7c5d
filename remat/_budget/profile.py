"""Stage 1, profile: a few tracked training steps of the model, marked block by block, that measure what every block
costs under each choice (a `Profile`; costs.py turns it into costs), on a fake twin of the model where one stands in.

NOTE [ Profiling rounds ]
A profile measures many (block, choice) pairs in each tracked training step, and derives what it need not run:
planning costs one tracked step with every block kept, and one block run alone to correct the clock.

Rules:
1. Full remat, `save_matmuls` and the choices that keep some matmuls (under the rerun strategy) are not run: they
   are derived from each block's run kept (NOTE [ Deriving choices ] and NOTE [ Some matmuls ] in
   costs_derived.py). The choices that run are kept and those that cannot be derived (policies passed as
   `choices=`, and full remat under the replay strategy); where more than `_EARLY` of the bytes the blocks'
   forwards left alive died before the first backward, the derivable choices are run too.
2. Blocks of one kind (same class, same parameter shapes) cost the same wherever they sit, up to what lies around
   them. So one tracked step measures many (block, choice) pairs at once: each choice to run is run by two blocks
   of each kind, the other blocks kept; as many rounds run as the smallest kind needs to see every choice.
3. A block's numbers are split into what depends on its position (the bytes live at its forward start beyond
   what the blocks before it hold: the "base") and what it adds itself (its held bytes, its peaks above its
   start); the second part is the block's own where it ran (or was derived) under that choice, else the (upper)
   median over the blocks of its kind that did; the first is always the block's own (costs.py).
4. The same step also keeps the clock (NOTE [ Timing under the tracker ] in profile_step.py): times are the median
   over blocks of a kind.
5. Profiling leaves the model as it found it: the RNG streams, the buffers (BatchNorm statistics) and `.grad`.

Implementation notes:
1. (rule 2) With k choices to run, in round r the m-th block of a kind takes slot p = m + r * (size of its kind)
   and runs under the (p mod k)-th while p < 2k (two samples of each), kept after that. Two samples of each
   rather than a third of the blocks each: the rematerialized blocks are what makes the profiled step slower than
   a plain one.
2. (rules 1, 2) With only kept to run, that is one round whatever the kinds: one tracked step, every block kept,
   each recorded in detail for the derivations (`Detail` in profile_step.py). That step peaks at no remat's
   activation peak (running two blocks of each kind under save_matmuls and full remat keeps it below that, not by
   much): profiling needs the memory of a plain training step.
3. (rule 3) In each round, hooks mark where every block's forward and backward start and end (a forward pre-hook
   and hook; gradient hooks on its first input and first output tensor), and a tracker records the peak of every
   window between two marks. Outside windows give `outside_peaks` (the largest over rounds) and `outside_time`.
4. (rule 4) What planning costs in training steps is what `python -m benchmarks --model budget` prints (column
   "plan (steps)"; figures in docs/benchmarks.md).

NOTE [ Planning on fake tensors ]
Rules:
1. `remat.apply(model, budget=B)` itself allocates no more than the larger of B and full remat's peak (with the
   chunked head where the head may be routed: NOTE [ The head as a choice ] in head_choice.py; with the
   verification's `SLACK`) above what was live when it began, and `apply(memory=M)` keeps the process within M: a
   model that fits only with remat can be planned on the device it will train on.
2. So the profile (one training step with every block kept, which needs no remat's memory) runs on fake tensors:
   the model's parameters and buffers are swapped for fake ones for the duration, the sample is made fake, and
   the step is timed by priced time (NOTE [ Priced time ] in remat/_measure/clock.py). The user's tensors are
   never touched and nothing is allocated on the device. The plan goes on the real blocks; the first real
   training step is tracked as a safety net (NOTE [ The first step ] in first_step.py).
3. Where a fake step cannot stand in for the real one, the profile runs on the real model and needs
   the memory of a plain training step: a model planned for one compiled graph (its costs are shifted by real
   compiled runs), a model sharded by `fully_shard` or wrapped in DDP (their collectives need real tensors), the
   replay strategy (its tape runs its recorded ops on the tensors it kept, which a fake profile mixes with real
   ones), a model that is fake, on meta or made of DTensors already (`remat.estimate`), and a step with a
   data-dependent op (`.item()`, `nonzero`), which fake tensors cannot run: that one is logged.

Implementation notes:
1. The fake twin is `fake_state` (NOTE [ Swapping in fake state ] in remat/_measure/fake.py); hooks and module
   attributes stay, so the blocks' choices are placed on the user's own modules while the profile runs and stay
   there after it.
2. The fake sample keeps one fake per tensor object (an `input_ids` that is also `labels` stays one tensor), and
   transformers' packed-sequence detection is kept off fake position ids, and its padding detection off a fake
   mask where the step's own has no padding (`real_masks_of`: NOTE [ transformers and fake tensors ]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from .._core.policies import save_matmuls
from .._core.torch_compat import FakeTensor, local_tensor
from .._engine.rng import devices_of
from .._engine.selective import SaveOps
from .._measure import ddp as _ddp
from .._measure.clock import clock_for, priced
from .._measure.fake import data_dependent, fake_mode, fake_sample, fake_state, note_fake_step, resolve_device
from .._measure.hf_fake import real_masks_of
from .._measure.loss import default_loss
from .._measure.state import step_state
from .._measure.step_autocast import StepAutocast, planning, step_region
from .._measure.track import placed
from .._sites.blocks import describe_unreached
from .profile_alone import Shift, compiled_shifts, mode_alone, time_alone
from .profile_step import Detail, Marks, marked_step, mode_overhead

__all__ = [
    "DERIVABLE", "PARTS", "GradientSteps", "KeptRun", "Loss", "Profile", "Round", "TrainingStep", "Twin",
    "accumulation_order", "fake_stands_in", "gradient_steps", "profile", "profile_blocks",
]

_T = TypeVar("_T")
_log = logging.getLogger("remat")
Loss = Callable[[Any], torch.Tensor]
Assign = Callable[[int, int], None]  # put block i under choice c
Twin = Callable[[nn.Module, torch.device], AbstractContextManager[list[torch.Tensor]]]
"""Swaps a fake twin's state into the model for a profile and yields its fake parameters (`fake_state`'s form)."""


#: Choices that keep some of the matmul outputs `save_matmuls` keeps (NOTE [ Some matmuls ]): label -> the
#: share of save_matmuls' matmul bytes they may keep.
PARTS = {"save_matmuls/4": 0.25, "save_matmuls/2": 0.5}
DERIVABLE = ("full", "save_matmuls", *PARTS)


@dataclass(frozen=True)
class Round:
    """What one profiled step measured (`Marks` in profile_step.py).

    Args:
        choice: the choice each block ran under.
        held: per block, the bytes its forward left alive.
        base: per block, the bytes live at its forward start beyond what the blocks before it held.
        peaks: per window (("fwd" | "bwd" | "out", index)), its peak above what the blocks before it held.
        times: per window, its seconds.
        kept: per block that ran kept and was recorded in detail, what derivations start from.
    """

    choice: Sequence[int]
    held: Sequence[int]
    base: Sequence[int]
    peaks: Mapping[tuple[str, int], int]
    times: Mapping[tuple[str, int], float]
    kept: Mapping[int, KeptRun] = field(default_factory=dict)


@dataclass(frozen=True)
class GradientSteps:
    """Gradient bytes alive while each block runs backward (`blocks`, n numbers) and in each window outside the
    blocks (`outside`, n + 1 numbers, as `ModelCost.outside_peaks`): NOTE [ Gradients in the budget ], and
    NOTE [ Compiled as one graph ] in costs_compiled.py."""

    blocks: tuple[int, ...]
    outside: tuple[int, ...]


@dataclass(frozen=True)
class Profile:
    """What the profile measured (stage 1, profile.py), for `measured_costs` (stage 2).

    Args:
        names: the blocks' qualified names, in forward order.
        kinds: per block, its kind (blocks of one kind cost the same up to where they sit).
        choices: the choices' labels.
        derived: the choices derived rather than run, index to label (NOTE [ Deriving choices ] in
            costs_derived.py).
        tracked: the rounds that measured bytes.
        timed: the rounds that measured times, in the same order (the same rounds where one step did both).
        alone: per choice run, a block of kind `sample_kind` timed alone (forward, backward seconds), or nothing
            (NOTE [ Timing under the tracker ] in profile_step.py).
        sample_kind: the kind of that block (None where no block ran alone).
        per_op: seconds per op of `save_matmuls`' dispatch mode.
        gradients: where backward's new gradients are alive (NOTE [ Gradients in the budget ]).
        compiled: derived choices are priced for one compiled graph (NOTE [ Compiled costs ] in costs_derived.py).
        priced: the times are ops priced on a nominal device (NOTE [ Priced time ] in remat/_measure/clock.py).
        shifts: per choice, what compiling adds to the bytes of a block of `sample_kind` (NOTE [ Compiled bytes ] in
            costs_compiled.py); empty where nothing is shifted.
        outside_inputs: the blocks' inputs made outside every block that nothing kept for backward, in bytes by the
            blocks that take them (NOTE [ Outside inputs ] in costs.py).
    """

    names: tuple[str, ...]
    kinds: tuple[Any, ...]
    choices: tuple[str, ...]
    derived: Mapping[int, str]
    tracked: Sequence[Round]
    timed: Sequence[Round]
    alone: Mapping[int, tuple[float, float]]
    sample_kind: Any
    per_op: float
    gradients: GradientSteps
    compiled: bool = False
    priced: bool = False
    shifts: Mapping[int, Shift] = field(default_factory=dict)
    outside_inputs: Mapping[frozenset[int], int] = field(default_factory=dict)


@dataclass(frozen=True)
class KeptRun:
    """One block's tracked run kept: the numbers a derivation starts from (bytes above S_i: NOTE [ Budget model ]).

    Args:
        base: bytes live at its forward start.
        held: bytes its forward left alive.
        forward_peak: the peak while its forward ran.
        backward_peak: the peak while its backward ran.
        at_backward: bytes live when its backward started.
        alive: bytes of its born storages still live when its backward started.
        outputs: its outputs' born storages (numbered as in `detail`).
        live_outputs: those of them that something outside the block still held when its backward started.
        read_outputs: those of them that an op after its forward read before backward started (the next block's
            input, the loss's); the others (attention weights a layer returns and the model drops) live on only in
            what the block saves itself (NOTE [ Outputs no one reads ] in costs_derived.py).
        detail: its forward window's allocations, op by op.
    """

    base: int
    held: int
    forward_peak: int
    backward_peak: int
    at_backward: int
    alive: int
    outputs: frozenset[int]
    live_outputs: frozenset[int]
    read_outputs: frozenset[int]
    detail: Detail


class TrainingStep:
    """One training step of `model` on the inputs: the scalar loss of its forward, under the autocast settings of
    the caller of `remat.apply` (NOTE [ A step's own autocast region ] in remat/_measure/step_autocast.py), ready for
    backward. Every step the planner runs (the profile's, a verification's) is one of these."""

    def __init__(self, model: nn.Module, loss: Loss | None, args: tuple[Any, ...], kwargs: dict[str, Any],
                 autocast: StepAutocast | None = None, devices: tuple[torch.device, ...] | None = None) -> None:
        self.model = model
        self.loss = loss or default_loss
        self.args, self.kwargs = args, kwargs
        self.devices = placed(model) if devices is None else devices
        self.autocast = StepAutocast.caller(self.devices) if devices is None else autocast

    def __call__(self, run: nn.Module | None = None) -> torch.Tensor:
        """The loss of `run` (the model, or a compiled copy of it) on the inputs."""
        with step_region(self.autocast):
            out = self.loss((self.model if run is None else run)(*self.args, **self.kwargs))
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            raise TypeError(
                f"remat: `loss` must return a scalar tensor, but it returned {type(out).__name__}"
                f"{'' if not isinstance(out, torch.Tensor) else f' of shape {tuple(out.shape)}'}."
            )
        return out

    def on(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TrainingStep:
        """The same step on other inputs (a fake copy of them), under the same autocast settings."""
        return TrainingStep(self.model, self.loss, args, kwargs, self.autocast, self.devices)

    @contextlib.contextmanager
    def planning(self) -> Iterator[None]:
        """Gradients on, and the caller's autocast settings for every step run inside (`planning`)."""
        with torch.enable_grad(), planning(self.autocast, self.devices):
            yield


def profile(
    names: Sequence[str],
    blocks: Sequence[nn.Module],
    choices: Sequence[str],
    step: TrainingStep,
    assign: Assign,
    *,
    derived: Collection[int],
    compiled: bool,
    fake: bool,
    twin: Twin | None = None,
    gradients_kept: bool = True,
) -> Profile:
    """Profile `blocks` under every choice (`profile_blocks`) on `step`, on a fake twin of the step's model where
    `fake` and the step runs there (NOTE [ Planning on fake tensors ]), else on the model itself.

    `twin` makes the fake twin where an engine owns the model (NOTE [ Budgets under DeepSpeed ZeRO ] in
    remat/_sites/integrations/deepspeed.py): the step runs there or not at all. Without `gradients_kept`, the
    gradients backward makes count only while it makes them (the engine takes each one)."""

    model = step.model

    def measured(run: TrainingStep) -> Profile:
        with accumulation_order(model) as order:  # NOTE [ Gradients in the budget ] in costs.py
            return profile_blocks(model, names, blocks, choices, run, assign, order, derived, compiled=compiled,
                                  gradients_kept=gradients_kept)

    found = _on_fake_twin(model, step, measured, twin) if fake else None
    profiled = measured(step) if found is None else found
    if not any(window == "fwd" for window, _ in profiled.tracked[0].peaks):  # NOTE [ Blocks that forward never calls ]
        raise ValueError(describe_unreached(model, names, "profiled a budget's", "there is nothing to plan"))
    return profiled


def fake_stands_in(model: nn.Module, strategy: str) -> bool:
    """Whether a fake twin of `model` can stand in for it in a profile (NOTE [ Planning on fake tensors ], rule 3;
    a compiled mode never asks)."""
    if strategy != "rerun" or _ddp.unwrap(model) is not None:
        return False
    for t in (*model.parameters(), *model.buffers()):
        local = local_tensor(t)  # a DTensor (a sharded model) has a local shard that is another tensor
        if local is not t or isinstance(t, FakeTensor) or t.device.type == "meta":
            return False
    return True


def _on_fake_twin(model: nn.Module, step: TrainingStep, measure: Callable[[TrainingStep], _T],
                  twin: Twin | None = None) -> _T | None:
    """`measure(step)` with `step` on a fake twin of `model` (`twin`'s, else `fake_state`'s) and a fake copy of its
    inputs; None where the step reads tensor values, which fake tensors do not have (NOTE [ Planning on fake
    tensors ]), unless an engine's `twin` is given: a real step is then no option, and the error says so. The
    model's tensors are swapped for fake ones while `measure` runs and put back after."""
    device = resolve_device(model, (step.args, step.kwargs), None)
    try:
        masks = real_masks_of(step.args, step.kwargs)  # it reads the step's mask: before the fake mode
        with fake_mode(), (twin or fake_state)(model, device), masks, torch.enable_grad():
            fake_args, fake_kwargs = fake_sample((step.args, step.kwargs), device)
            return measure(step.on(tuple(fake_args), fake_kwargs))
    except Exception as error:
        translated = data_dependent(error, type(model).__name__)
        if translated is None:
            note_fake_step(error, "the budget's profile", f"`{type(model).__name__}`")
            raise
        if twin is not None:  # an engine's model is never profiled on a real step it would see
            raise translated from error
        _log.warning("remat: %s's step reads tensor values, which fake tensors lack (%s); its budget is profiled "
                     "on a real step, which needs the memory of a plain training step.", type(model).__name__,
                     type(error).__name__)
        return None


@contextlib.contextmanager
def accumulation_order(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside: the list of `model`'s parameters in the order backward first accumulated their gradients (NOTE
    [ Gradients in the budget ] in costs.py)."""
    order: list[torch.Tensor] = []
    seen: set[int] = set()

    def accumulated(param: torch.Tensor) -> None:
        if id(param) not in seen:
            seen.add(id(param))
            order.append(param)

    handles = [p.register_post_accumulate_grad_hook(accumulated)  # type: ignore[no-untyped-call]
               for p in model.parameters() if p.requires_grad]
    try:
        yield order
    finally:
        for handle in handles:
            handle.remove()


def _block_kind(block: nn.Module) -> tuple[Any, ...]:
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())
    return (type(block), repr(block), params)


_EARLY = 0.05  # of the bytes blocks hold, dying before the first backward: then derived choices are run instead

_SAMPLES = 2  # blocks of a kind that run each choice in the profiled step, at most; see NOTE [ Profiling rounds ]


def _rounds(blocks: Sequence[nn.Module], run: Sequence[int]) -> list[list[int]]:
    """Per round, the choice of each block: the choices in `run` (indices), in turn over the blocks of a kind."""
    k = len(run)
    kinds = [_block_kind(b) for b in blocks]
    members: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i, kind in enumerate(kinds):
        members[kind].append(i)
    rank = {i: m for group in members.values() for m, i in enumerate(group)}
    size = {i: len(members[kind]) for i, kind in enumerate(kinds)}
    count = max(-(-k // len(group)) for group in members.values())
    slot = [[rank[i] + r * size[i] for i in range(len(blocks))] for r in range(count)]
    return [[run[p % k] if p < _SAMPLES * k else run[0] for p in row] for row in slot]


def profile_blocks(
    model: nn.Module,
    names: Sequence[str],
    blocks: Sequence[nn.Module],
    choices: Sequence[str],
    step: Callable[[], torch.Tensor],
    assign: Assign,
    order: Sequence[torch.Tensor],
    derived: Collection[int] = (),
    closed: Collection[int] = (),
    compiled: bool = False,
    gradients_kept: bool = True,
) -> Profile:
    """Profile `blocks` of `model` under every choice on the training step `step` (NOTE [ Profiling rounds ]).

    Args:
        model: the model that `step` runs (its RNG devices, buffers and gradients are left as they were).
        names: the blocks' qualified names, in forward order.
        blocks: the blocks themselves, in forward order.
        choices: labels of the choices, in the order `assign` numbers them; choice 0 keeps the block as it is.
        step: runs the model's forward on the sample and returns the scalar loss.
        assign: `assign(i, c)` puts block i under choice c (the caller applies or removes the hooks).
        order: the parameters in the order backward reached them, filled while the steps run
            (`accumulation_order`).
        derived: choices derived from the blocks' runs kept instead of run (labelled "full" or "save_matmuls",
            with the rerun strategy: NOTE [ Deriving choices ] in costs_derived.py). The parts (`PARTS`, NOTE
            [ Some matmuls ]) can only be derived: where derivations do not hold, they are open to no block.
        closed: choices neither run nor derived: open to no block.
        compiled: for one compiled graph: derived choices priced as compiled code runs them (NOTE [ Compiled
            costs ]), and the sample block's bytes measured compiled (NOTE [ Compiled bytes ] in costs_compiled.py).
        gradients_kept: a default loop's gradients, alive from where backward makes them to the step's end (NOTE
            [ Gradients in the budget ]); False where an engine takes each one as it is made (NOTE [ Budgets under
            DeepSpeed ZeRO ] in remat/_sites/integrations/deepspeed.py): only the bytes backward allocates count.

    Returns:
        What the steps measured, for `measured_costs` in costs.py.
    """
    run = [c for c in range(len(choices)) if c not in derived and c not in closed]
    if derived and run[:1] != [0]:
        raise ValueError("remat: derived choices need choice 0 (kept) to be run.")
    rounds = _rounds(blocks, run)
    params = [p for p in model.parameters() if p.requires_grad]
    devices = devices_of(params, module=model)
    alone: dict[int, tuple[float, float]] = {}
    # gradients are outside the budget; RNG streams put back; fake tensors priced: NOTE [ Priced time ] in clock.py
    with clock_for([*model.parameters(), *model.buffers()]), step_state(model):
        exact = priced()  # the tracked step's times: nothing to correct them with
        apart = not exact and bool(placed(model))  # NOTE [ Timing under the tracker ] in profile_step.py
        samples = {} if apart or exact else _samples(blocks, rounds, len(run))
        tracked: list[Marks] = []
        timed: list[Marks] = []
        for choice in rounds:
            for i, c in enumerate(choice):
                assign(i, c)
            here = {b for r, b in samples.values() if r == len(tracked)}
            kept = [i for i, c in enumerate(choice) if c == 0] if derived else []
            # one graph keeps every gradient (NOTE [ Compiled as one graph ]); an engine takes each one
            made = params if gradients_kept and not compiled else ()
            tracked.append(marked_step(step, blocks, True, not apart, devices, here, kept, made))
            timed.append(marked_step(step, blocks, False, True, devices) if apart else tracked[-1])
        again = derived and any(marks.early is not None and marks.early[1] > _EARLY * marks.early[0]
                                for marks in tracked)
        for choice_run, (r, sample) in ({} if again else samples).items():  # none alone for a profile redone
            assign(sample, choice_run)
            try:
                alone[choice_run] = time_alone(blocks[sample], tracked[r].specs[sample], devices)
            except Exception:  # only a refinement: NOTE [ Timing under the tracker ]
                alone.clear()
                break
        timing = alone and not compiled  # no dispatch mode runs in compiled code
        per_op = _per_op(blocks, choices, derived, tracked, samples, assign, devices) if timing else None
        if per_op is None:
            moded = not compiled and any(choices[c] != "full" for c in derived)
            per_op = mode_overhead() if moded else 0.0
        shifts: dict[int, Shift] = {}
        if compiled and not again and 0 in samples:  # NOTE [ Compiled bytes ] in costs_compiled.py
            r, sample = samples[0]
            shifts = compiled_shifts(blocks[sample], tracked[r].specs[sample], [0, *derived, *run[1:]],
                                     lambda c: assign(sample, c))
    inputs = _dead_inputs(rounds, tracked)
    if again:
        parts = [c for c in derived if choices[c] in PARTS]  # NOTE [ Deriving choices ]: run the others
        redone = profile_blocks(model, names, blocks, choices, step, assign, order, closed=parts, compiled=compiled,
                                gradients_kept=gradients_kept)
        return dataclasses.replace(redone, outside_inputs=inputs or redone.outside_inputs)  # kept ran here
    return Profile(
        names=tuple(names),
        kinds=tuple(_block_kind(b) for b in blocks),
        choices=tuple(choices),
        derived={c: choices[c] for c in derived},
        tracked=[_round(choice, marks, _kept_runs(marks)) for choice, marks in zip(rounds, tracked, strict=True)],
        timed=[_round(choice, marks, {}) for choice, marks in zip(rounds, timed, strict=True)],
        alone=alone,
        sample_kind=_block_kind(blocks[samples[0][1]]) if samples else None,
        per_op=per_op,
        gradients=gradient_steps(blocks, order),
        compiled=compiled,
        priced=exact,  # NOTE [ Priced time ]: relative, not this device's
        shifts=shifts,
        outside_inputs=inputs,
    )


def _per_op(
    blocks: Sequence[nn.Module], choices: Sequence[str], derived: Collection[int], tracked: Sequence[Marks],
    samples: dict[int, tuple[int, int]], assign: Assign, devices: Sequence[torch.device],
) -> float | None:
    """Seconds per op of `save_matmuls`' dispatch mode on the sample block kept: NOTE [ Mode cost in place ] in
    costs_derived.py. None where no derived choice runs the mode, or the block cannot tell."""
    if 0 not in samples or all(choices[c] == "full" for c in derived):
        return None
    r, sample = samples[0]
    found = tracked[r].details.get(sample)
    if found is None or not found[0].ops:
        return None
    assign(sample, 0)
    try:
        added = mode_alone(blocks[sample], tracked[r].specs[sample], devices, lambda: SaveOps(save_matmuls))
    except Exception:  # only a refinement, as the block's own time alone
        return None
    return max(mode_overhead(), added / found[0].ops)


def _round(choice: list[int], marks: Marks, kept: dict[int, KeptRun]) -> Round:
    return Round(choice, marks.held, marks.base, marks.peaks, marks.times, kept)


def _dead_inputs(rounds: Sequence[Sequence[int]], tracked: Sequence[Marks]) -> dict[frozenset[int], int]:
    """The blocks' inputs made outside every block that nothing kept for backward, in bytes by the blocks that take
    them: from the steps in which all those blocks ran kept (choice 0), the largest (NOTE [ Outside inputs ] in
    costs.py)."""
    groups: dict[frozenset[int], int] = {}
    for choice, marks in zip(rounds, tracked, strict=True):
        step: defaultdict[frozenset[int], int] = defaultdict(int)
        for nbytes, users in marks.outside_inputs or ():
            if all(choice[i] == 0 for i in users):
                step[users] += nbytes
        for users, nbytes in step.items():
            groups[users] = max(groups.get(users, 0), nbytes)
    return groups


def _kept_runs(marks: Marks) -> dict[int, KeptRun]:
    """The runs kept recorded in detail whose backward ran: what derivations start from."""
    out: dict[int, KeptRun] = {}
    read = marks.tracker.read if marks.tracker is not None else set()
    for i, (detail, outputs) in marks.details.items():
        if i not in marks.at_backward:
            continue  # its backward never ran: nothing to derive from
        at, alive, live = marks.at_backward[i]
        held = marks.held[i]
        forward = marks.peaks.get(("fwd", i), marks.base[i] + held)
        backward = marks.peaks.get(("bwd", i), marks.base[i] + held)
        out[i] = KeptRun(marks.base[i], held, forward, backward, at, alive, frozenset(k for k, _ in outputs), live,
                         frozenset(n for block, n in read if block == i), detail)
    return out


def _samples(blocks: Sequence[nn.Module], rounds: list[list[int]], k: int) -> dict[int, tuple[int, int]]:
    """Per choice run, the first (round, block) in which a block of the largest kind runs it (run alone later)."""
    members: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i, block in enumerate(blocks):
        members[_block_kind(block)].append(i)
    largest = max(members.values(), key=len)
    out: dict[int, tuple[int, int]] = {}
    for r, choice in enumerate(rounds):
        for b in largest:
            out.setdefault(choice[b], (r, b))
    return out if len(out) == k else {}


# -- where backward's new gradients are alive: NOTE [ Gradients in the budget ] in costs.py ---------------------------

def _tensor_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def gradient_steps(blocks: Sequence[nn.Module], order: Sequence[torch.Tensor]) -> GradientSteps:
    """Where backward's new gradients are alive, from the order it made them (NOTE [ Gradients in the budget ]).

    >>> import torch
    >>> blocks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]   # 24 bytes of gradients each
    >>> head = torch.nn.Parameter(torch.ones(4))                  # 16 bytes, reached first
    >>> order = [head, *blocks[1].parameters(), *blocks[0].parameters()]
    >>> steps = gradient_steps(blocks, order)
    >>> steps.blocks, steps.outside
    ((40, 16), (64, 40, 0))
    """
    n, total = len(blocks), len(order)
    position = {id(p): q for q, p in enumerate(order)}
    before = [0]
    for p in order:
        before.append(before[-1] + _tensor_bytes(p))  # before[q]: bytes of the first q gradients made
    first: list[int | None] = []
    last: list[int | None] = []
    for block in blocks:
        found = [position[id(p)] for p in block.parameters() if id(p) in position]
        first.append(min(found) if found else None)
        last.append(max(found) if found else None)
    start = [total] * n  # where block i's backward starts, in gradients made (a block without any: the next below)
    end = [total] * n
    below_first = total
    for i in range(n):  # from block 0 up: a parameterless block takes the bounds of the next one below it
        opened, closed = first[i], last[i]
        if opened is None or closed is None:
            start[i] = end[i] = below_first
        else:
            below_first = start[i] = opened
            end[i] = closed + 1
    outside = [before[end[k]] for k in range(n)] + [0]
    return GradientSteps(tuple(before[s] for s in start), tuple(outside))
