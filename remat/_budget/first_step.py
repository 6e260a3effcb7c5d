"""A budgeted model's first training step is tracked, and its plan corrected from it before the next step.

NOTE [ The first step ]
A plan's peak is a prediction; the budget's promise is about real steps (NOTE [ Checking the plan ] in check.py).
Where the prediction fits, the model's own first training step is the check, so planning costs the profile alone.

Rules:
1. Where the prediction fits the budget, the plan is returned unchecked, and the model's first training step
   checks it: from the forward that starts it to the end of the first backward through its outputs, a `Tracker`
   counts what the step allocates, as the up-front check would.
2. The peak shows in `remat.plan(model)` as soon as that backward ends; the decision waits for the model's next
   forward (on every rank: the peak is the largest over them), which runs with the corrected plan where the step
   went over the budget, and is tracked in turn, up to the up-front check's number of steps.
3. Where even the choice that holds least measures over the budget's slack, a `UserWarning` carries the
   `BudgetError` text and that choice stays on the blocks: raising in the middle of training would not leave the
   user a model that trains.
4. Tracking a step disturbs neither the user's modes nor compilation: a step is tracked only where no dispatch
   mode but another tracked step's is on when its forward starts, and compiled blocks still compile.
5. The up-front check stays where the first step cannot stand in for it: a budget whose prediction does not fit
   (only a measured step may refuse it: NOTE [ Checking the plan ]), `memory=` (the device's whole memory: going
   over is an out-of-memory error, not a missed promise), a model planned for one compiled graph (its steps run in
   compiled code, which a dispatch mode cannot count), and a model sharded by `fully_shard` (its sharded gradients
   are made outside autograd's accumulation, so a first step could not tell them from activations).

Implementation notes:
1. (rule 1) Checking a plan on one more step of the sample before `remat.apply` returns costs a step of the plan
   itself on top of the profile's step: planning would take about three training steps. A step starts at a call
   of the model in training mode with gradients on. A step whose parameters had no gradients creates them; those
   are not activations, and the up-front check starts with zero gradients that backward adds into in place, so
   each new gradient is forgotten by the tracker once it is accumulated (a post-accumulate-grad hook): until then
   both count it, as the incoming gradient.
2. (rule 2) The backward's end is an autograd final callback, queued by a gradient hook on the model's outputs.
3. (rule 4) The tracker's dispatch mode is pushed when the step starts. It cannot be popped when the backward
   ends: autograd runs final callbacks under the thread-local state it saved when the backward began, mode stack
   included, and puts that state back after them (on an accelerator they may also run on another thread). So the
   mode stops counting there and passes every op straight through until the first of these pops it: the death of
   the step's graph outside a backward (a token in the metadata of the outputs' autograd nodes dies with them,
   once the loss is let go of after backward), the next `optimizer.step()` of any optimizer (a global pre-hook,
   there only while a step is tracked), the model's next forward, `remat.undo(model)`; on the thread that pushed
   it and only from the top of the stack (a mode the user pushed since stays, and ours waits for a later chance).
   A loop that steps an optimizer after backward has it off the stack before the step's update.
4. (rule 4) A mode pushed in a forward and popped at a later one could be popped in its place by the `__exit__`
   of a mode the user entered before it (torch pops the top of the stack, whichever it is): hence the rule that
   no other mode is on (a step run under `remat.track()`, a FLOP counter or a fake-tensor mode is not tracked,
   and the check waits for a later step). A forward whose graph dies with no backward through it (evaluation
   with gradients on, a forward alone) ends the window untracked, and the next training forward starts another;
   a window kept open by forwards whose graphs live on with no backward through them is dropped after `WINDOW` of
   them, and with it the check.
5. (rule 4) Dynamo does not compile a frame it meets under a dispatch mode: it runs it in eager code, and marks
   its code to run in eager code for good, so a block compiled with `block.compile()` whose first call fell in
   the tracked step would never be compiled. So while the step is tracked, compiled code runs in eager code by
   dynamo's "force_eager" stance, which marks nothing (the step measures the blocks' eager code, as the up-front
   check did on a model not yet compiled), and the stance is put back when the mode is popped; the step after it
   compiles. On a torch without stances (before 2.6), no step is tracked once dynamo is in use, and the plan
   stays unchecked; nor is one that starts inside a compiled call (a model called from compiled code after a
   graph break), where no stance can be set. The profile and the up-front check run under the same stance, for
   the same reason: a model whose blocks were compiled before `remat.apply(model, budget=...)`, or that re-plans
   for a new shape, compiles them after.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from .._core.torch_compat import (
    can_run_eager,
    dispatch_modes_on,
    eager_for_now,
    graph_task_id,
    top_dispatch_mode,
    tree_leaves,
)
from .._engine.compiled import in_compiled_call
from .._measure.step_tracker import StepTracker

__all__ = ["WINDOW", "FirstStep", "can_track", "pop_closed"]

WINDOW = 8  # forwards with no backward through them after which a step window is dropped
_TOKEN = "remat.first_step"
_PUSHED: dict[int, FirstStep] = {}  # the tracked steps whose mode is on a stack, by id


def can_track() -> bool:
    """Whether a step may be tracked now: every dispatch mode on this thread's stack is a tracked step's (none is
    the user's), and compiled code can be made to run in eager code while it is (NOTE [ The first step ])."""
    return dispatch_modes_on() <= len(_PUSHED) and not in_compiled_call() and can_run_eager()


def pop_closed() -> None:
    """Pop the modes of closed steps that were not on top of the stack when they closed."""
    for step in [step for step in _PUSHED.values() if step.closed]:
        step._stop()


class _Token:
    """Put in the metadata of an output's autograd node, to learn when the graph dies."""


class _Hook:
    """A hook of a tracked step, on the model or its parameters: a copy of the model (`deepcopy`, pickle) made
    while the step is tracked gets one that does nothing."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[..., None]) -> None:
        self._fn = fn

    def __call__(self, *args: Any) -> None:
        self._fn(*args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Hook, (_nothing,))


def _nothing(*args: Any) -> None:
    return None


class FirstStep:
    """Track one training step of `model`, from now to the end of the first backward through its outputs.

    Attributes:
        peak: the step's tracked peak above what was live when it started, new gradients left out; None until
            a backward through the model's outputs has ended.
        forwards: the model's forwards seen in this window.
        closed: whether `close` was called (its mode is popped as soon as it is on top: `pop_closed`).
    """

    def __init__(self, model: nn.Module, ended: Callable[[int], None]) -> None:
        self.peak: int | None = None
        self.forwards = 1
        self.closed = False
        self._ended_with = ended
        self._queued = False
        self._owner = threading.get_ident()
        self._tracker = StepTracker()
        self._hooks: list[RemovableHandle] = [model.register_forward_hook(_Hook(self._outputs))]
        self._optimizer_hook = register_optimizer_step_pre_hook(_Hook(self._optimizer_step))
        self._watched: dict[int, weakref.ref[_Token]] = {}  # the tokens of the outputs' graphs, by id
        self._restore = eager_for_now()  # compiled code under the tracker: see NOTE [ The first step ]
        self._tracker.__enter__()
        self._mode = top_dispatch_mode()
        self._on = True
        _PUSHED[id(self)] = self

    def _outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._reached)  # type: ignore[no-untyped-call]
                if leaf.grad_fn is not None:  # the node's metadata lives as long as the node
                    metadata: dict[str, Any] = leaf.grad_fn.metadata  # type: ignore[assignment]
                    token = metadata.setdefault(_TOKEN, _Token())
                    key = id(token)
                    self._watched.setdefault(key, weakref.ref(token, functools.partial(self._dropped, key)))

    def _dropped(self, key: int, ref: object = None) -> None:
        # A graph the step made died: after its backward, where the user let go of the loss, or with no backward
        # through it (a forward alone: the step is over, untracked). NOTE [ The first step ]
        self._watched.pop(key, None)
        if (self.peak is not None or not self._watched) and graph_task_id() < 0:
            self._stop()
            if not self._on:  # the optimizer hook goes too (an optimizer step may have popped the mode already)
                self._optimizer_hook.remove()

    @property
    def dropped(self) -> bool:
        """Whether the step's graphs died with no backward through them: no step to measure."""
        return self.peak is None and not self._on

    def _reached(self, grad: torch.Tensor) -> None:
        if not self._queued and self.peak is None:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._ended)

    def _ended(self) -> None:
        self.peak = self._tracker.peak_bytes
        self._tracker.pause()  # popped later, outside the backward: NOTE [ The first step ]
        self._ended_with(self.peak)

    def _optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.peak is not None:  # the step's backward has ended: NOTE [ The first step ]
            self._stop()  # this hook stays: torch is iterating over the optimizer hooks

    def _stop(self) -> None:
        """Pop the tracker's mode where this thread pushed it and it is on top (NOTE [ The first step ]), and
        remove the hooks on the model and its parameters."""
        if self._on and threading.get_ident() == self._owner and top_dispatch_mode() is self._mode:
            self._on = False
            del _PUSHED[id(self)]
            self._tracker.__exit__(None, None, None)
            if self._restore is not None:
                self._restore()
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()

    def close(self) -> None:
        """Remove every hook and stop tracking; the mode is popped now, or by `pop_closed` once it is on top."""
        self.closed = True
        for handle in (*self._hooks, self._optimizer_hook):
            handle.remove()
        self._hooks.clear()
        self._watched.clear()
        self._stop()
