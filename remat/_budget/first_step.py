"""Stage 4, verify, on the model's own step: a budgeted model's first training step is tracked, and its assignment
corrected from it before the next step.

NOTE [ The first step ]
Verifying an assignment on one more step of the sample before `remat.apply` returns costs a step of it on top of
the profile's. So where the prediction fits the budget and the regime allows it (regimes.py), the assignment is
returned unverified, and the model's first training step verifies it (NOTE [ Verifying the plan ] in verify.py).

Rules:
1. The window runs from the forward that starts a step (a call of the model in training mode with gradients on)
   to the end of the first backward through its outputs. It counts what the step allocates above what was live
   when it began, new gradients included, as `remat.track()` around the step counts it; the peak shows in
   `remat.plan(model)` at once.
2. The decision waits for the model's next forward (on every rank: the peak is the largest over them), which runs
   with the corrected assignment where the step went over the budget and is tracked in turn, up to `STEPS` steps
   (verify.py). Where even the choice that holds least measures over the budget's slack, a `UserWarning` carries
   the `BudgetError` text and that choice stays on the blocks: the model still trains.
3. Under the user's own `remat.track()` (its mode on top of the stack when the forward starts) the step's tracker
   rides on the user's (NOTE [ Riders ] in remat/_measure/track.py): no mode is pushed, the user's numbers are
   those of their block. Where no dispatch mode is on but other tracked steps', the step pushes a mode of its own.
   Under any other mode (a FLOP counter, a fake-tensor mode) the verification waits for a later step.
4. Nothing outlives the step: between steps no hook of remat's is in torch's global tables and no mode of its own
   is on a stack, except that a loop without an optimizer that keeps its loss alive keeps the paused mode until
   the next forward.
5. A window ends at once, untracked, where its forward raises or its outputs need no gradient, where its graph
   dies with no backward through it (evaluation with gradients on), and where the user's tracker it rides on ends
   before the backward does; the next training forward starts another. A window kept open by forwards whose
   graphs live on with no backward through them is dropped after `WINDOW` of them, and with it the verification.
6. Compiled blocks stay compiled: while remat's own mode is on, compiled code runs in eager code, and the step
   after it compiles.

Implementation notes:
1. (rule 1) The end of the backward is an autograd final callback, queued by a gradient hook on the model's
   outputs.
2. (rule 3) A mode pushed in a forward and popped at a later one could be popped in its place by the `__exit__` of
   a mode the user entered before it (torch pops the top of the stack): so no mode of ours goes under another's.
3. (rule 4) A mode of its own cannot be popped when the backward ends: autograd runs final callbacks under the
   thread-local state it saved when the backward began, mode stack included, and puts that state back after them
   (on an accelerator they may also run on another thread). So the mode stops counting there and is popped at the
   first of: the next `optimizer.step()` of any optimizer, before its update (a global step pre-hook, registered
   when the backward ends and taken out in the same step after the update: torch iterates over the table that
   holds it before that); the death of the step's graph outside a backward (a token in the metadata of the
   outputs' autograd nodes dies with them: a loss let go of after backward); the model's next forward;
   `remat.undo(model)` or a new `remat.apply`. It is popped on the thread that pushed it, and only from the top
   of the stack (a mode the user pushed since stays, and ours waits for a later chance).
4. (rule 5) The forward's end is an always-called forward hook.
5. (rule 6) Dynamo does not compile a frame it meets under a dispatch mode and marks its code to run in eager code
   for good, so a block compiled with `block.compile()` whose first call fell in a tracked step would never be
   compiled. While remat's own mode is on, dynamo's "force_eager" stance runs compiled code in eager code and
   marks nothing (the step measures the blocks' eager code, as the up-front verification does on a model not yet
   compiled); it is put back when the mode is popped. On a torch without stances (before 2.6), no step is
   tracked under remat's own mode once dynamo is in use, and the assignment stays unverified; nor is one that
   starts inside a compiled call (a model called from compiled code after a graph break), where no stance can be
   set. The profile and the up-front verification run under the same stance, for the same reason. A step riding
   on the user's tracker sets no stance: the user's mode is on either way.
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
    after_update,
    can_run_eager,
    dispatch_modes_on,
    eager_for_now,
    graph_task_id,
    in_optimizer_step,
    top_dispatch_mode,
    tree_leaves,
    undo_after_update,
)
from .._engine.compiled import in_compiled_call
from .._measure.step_tracker import StepTracker
from .._measure.track import Tracker, riding_host

__all__ = ["WINDOW", "FirstStep", "can_track", "tidy"]

WINDOW = 8  # forwards with no backward through them after which a step window is dropped
_TOKEN = "remat.first_step"
_LOCK = threading.RLock()
_PUSHED: dict[int, FirstStep] = {}  # the tracked steps whose own mode is on a stack, by id, in push order


def can_track() -> bool:
    """Whether a step may be tracked now (NOTE [ The first step ], rule 3): it can ride on the user's tracker, or
    every dispatch mode on this thread's stack is a tracked step's and compiled code can be made to run in eager
    code while its own is on."""
    if in_compiled_call():
        return False
    if riding_host() is not None:
        return True
    me = threading.get_ident()
    ours = sum(1 for step in list(_PUSHED.values()) if step._owner == me)
    return dispatch_modes_on() <= ours and can_run_eager()


def tidy() -> None:
    """Pop the modes of finished steps that are on top of this thread's stack, and take out the optimizer hook
    once no mode waits (NOTE [ The first step ], rule 4). Called at a budgeted model's forward."""
    _pop_finished()
    _optimizer_hook.release()


def _pop_finished() -> None:
    """Pop, top first, the modes of this thread's finished steps while one of them is on top; not in a backward,
    whose mode stack is the one autograd saved."""
    if graph_task_id() >= 0:
        return
    me = threading.get_ident()
    while True:
        top = top_dispatch_mode()
        with _LOCK:
            step = next((s for s in _PUSHED.values() if s._mode is top and s._owner == me and not s._counting), None)
        if step is None:
            return
        step._pop()


def _waiting() -> bool:
    """Whether a finished step's mode is still on a stack."""
    with _LOCK:
        return any(not step._counting for step in _PUSHED.values())


class _OptimizerHook:
    """The global optimizer-step pre-hook that pops finished steps' modes before an update: in torch's table only
    while such a mode waits (NOTE [ The first step ], implementation note 3)."""

    def __init__(self) -> None:
        self._handle: RemovableHandle | None = None
        self._after: list[weakref.ref[Any]] = []  # optimizers whose step will take the hook out after its update

    def wait(self) -> None:
        """A finished step's mode waits to be popped: be there at the next optimizer step."""
        with _LOCK:
            if self._handle is None:
                self._handle = register_optimizer_step_pre_hook(_Hook(self._before_update))

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        _pop_finished()
        # torch is iterating over the table that holds this hook: it goes after the update (where this torch's
        # optimizer has no such point, at the next forward)
        self._take_out_after(optimizer)

    def _take_out_after(self, optimizer: Any) -> None:
        if after_update(optimizer, functools.partial(self.release, stepping=False)):
            with _LOCK:
                self._after.append(weakref.ref(optimizer))

    def release(self, stepping: bool | None = None) -> None:
        """Take the hook out if no mode waits; `stepping`: whether torch may be iterating over its table now
        (None: find out). What `after_update` left on an optimizer whose step raised goes too."""
        if self._handle is None and not self._after:
            return
        if stepping is None:
            stepping, optimizer = in_optimizer_step()
            if stepping and optimizer is not None:  # an optimizer's update (an LBFGS closure): after it, then
                self._take_out_after(optimizer)
        with _LOCK:
            if stepping or _waiting():
                return
            handle, self._handle = self._handle, None
            after, self._after = self._after, []
        if handle is not None:
            handle.remove()
        for ref in after:
            optimizer = ref()
            if optimizer is not None:
                undo_after_update(optimizer)


_optimizer_hook = _OptimizerHook()


class _Token:
    """Put in the metadata of an output's autograd node, to learn when the graph dies."""


class _Hook:
    """A hook of a tracked step: a copy of the model (`deepcopy`, pickle) made while the step is tracked gets one
    that does nothing, and one that is done does nothing while it waits to be removed."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> None:
        self.fn(*args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Hook, (_nothing,))


def _nothing(*args: Any) -> None:
    return None


class FirstStep:
    """Track one training step of `model`, from now to the end of the first backward through its outputs.

    Args:
        set_apart: asked at each new storage whether an engine allocates it for itself (NOTE [ Set apart ] in
            remat/_measure/step_tracker.py); None: nothing is set apart.

    Attributes:
        peak: the step's tracked peak above what was live when it started, without what was set apart; None until
            a backward through the model's outputs has ended.
        forwards: the model's forwards seen in this window.
    """

    def __init__(self, model: nn.Module, ended: Callable[[int], None],
                 set_apart: Callable[[], bool] | None = None) -> None:
        self.peak: int | None = None
        self.forwards = 1
        self.model_name = type(model).__name__
        self._ended_with = ended
        self._queued = False
        self._counting = True
        self._owner = threading.get_ident()
        self._tracker = StepTracker(set_apart)  # an engine's own buffers: NOTE [ Set apart ] in step_tracker.py
        self._watched: dict[int, weakref.ref[_Token]] = {}  # the tokens of the outputs' graphs, by id
        self._mode: Any = None  # our own mode, while it is on the stack
        self._restore: Callable[[], None] | None = None
        self._host: Tracker | None = riding_host()
        self._forward = _Hook(self._outputs)
        self._handle = model.register_forward_hook(self._forward, always_call=True)
        if self._host is not None:  # NOTE [ The first step ], rule 3
            self._tracker.on_host_exit = self._host_gone
            self._host._ride(self._tracker)
            return
        self._restore = eager_for_now()  # compiled code under our mode: rule 6
        try:
            self._tracker.__enter__()
        except BaseException:
            self._handle.remove()
            self._release()
            raise
        self._mode = top_dispatch_mode()
        with _LOCK:
            _PUSHED[id(self)] = self

    @property
    def set_apart(self) -> int:
        """The most bytes an engine's own buffers held at once in the window, set apart from `peak` (NOTE [ Set
        apart ] in remat/_measure/step_tracker.py)."""
        return self._tracker.apart_peak

    @property
    def dropped(self) -> bool:
        """Whether the window ended with no backward through the step's outputs: no step to measure."""
        return self.peak is None and not self._counting

    # -- the step ---------------------------------------------------------------------------------------------
    def _outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        needs_grad = False
        for leaf in tree_leaves(output):  # `output` is None where the forward raised
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                needs_grad = True
                leaf.register_hook(self._reached)  # type: ignore[no-untyped-call]
                if leaf.grad_fn is not None:  # the node's metadata lives as long as the node
                    metadata: dict[str, Any] = leaf.grad_fn.metadata  # type: ignore[assignment]
                    token = metadata.setdefault(_TOKEN, _Token())
                    key = id(token)
                    self._watched.setdefault(key, weakref.ref(token, functools.partial(self._dropped, key)))
        if not needs_grad and not self._watched and self.peak is None:
            # no backward can come through this window: it ends untracked (torch is iterating over the model's
            # forward hooks, so ours stays, doing nothing, until the next forward or `close`)
            self._finish(hooks=False)

    def _reached(self, grad: torch.Tensor) -> None:
        if not self._queued and self.peak is None and self._counting:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._ended)

    def _ended(self) -> None:
        if not self._counting:
            return
        self.peak = self._tracker.peak_bytes
        self._finish(hooks=True)
        self._ended_with(self.peak)

    def _dropped(self, key: int, ref: object = None) -> None:
        # A graph the step made died: after its backward, where the user let go of the loss, or with no backward
        # through it (a forward alone: the window ends untracked). NOTE [ The first step ], rule 5
        self._watched.pop(key, None)
        if graph_task_id() >= 0:
            return  # inside a backward: the window's end or the next forward settles it
        if self._counting and self.peak is None and not self._watched:
            self._finish(hooks=True)
        else:
            tidy()

    def _host_gone(self) -> None:
        """The user's tracker this step rides on ended its block before the step did: the window ends untracked."""
        if self._counting:
            self._finish(hooks=False)

    # -- the end ----------------------------------------------------------------------------------------------
    def _finish(self, *, hooks: bool) -> None:
        """Stop counting; pop our mode now where we can, else leave it to the optimizer hook, the graph's death or
        a forward; remove the model's hook where torch is not iterating over its table (`hooks`)."""
        self._counting = False
        self._tracker.pause()
        if self._host is not None:
            self._host._unride(self._tracker)
            self._host = None
        self._forward.fn = _nothing
        if hooks:
            self._handle.remove()
        if self._mode is None:
            return
        _pop_finished()
        with _LOCK:
            waits = id(self) in _PUSHED
        if waits:
            _optimizer_hook.wait()
        else:
            _optimizer_hook.release()

    def _pop(self) -> None:
        """Pop our mode (on top of the stack, on its thread), put the stance back and let go of the graphs."""
        with _LOCK:
            if _PUSHED.pop(id(self), None) is None:
                return
        self._mode = None
        try:
            self._tracker.__exit__(None, None, None)
        finally:
            self._release()

    def _release(self) -> None:
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()
        self._watched.clear()  # dropping the weak references drops their callbacks

    def close(self) -> None:
        """End the window and remove every hook; the mode is popped now, or by `tidy` once it is on top."""
        if self._counting:
            self._finish(hooks=True)
        self._handle.remove()
        _pop_finished()
        if self._mode is None:
            self._release()
        _optimizer_hook.release()
