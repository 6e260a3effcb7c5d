"""One training step with marks where each block's forward and backward start and end (NOTE [ Profiling rounds ]
in profile.py): tracked for bytes, timed, or both (NOTE [ Timing under the tracker ] in windows.py).

A forward pre-hook and hook on each block and gradient hooks on its first input and first output tensor switch
the tracker's window; `Recorder` keeps each window's peak and clock, the blocks' inputs described for a run alone
(`describe`), and for the blocks recorded in detail (run kept, to derive their other choices) what their forward
allocated and which of it was still alive when backward started.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from .._core.torch_compat import tree_leaves
from .._measure.clock import now
from .._measure.track import _storage, synchronize
from .alone import describe
from .windows import Detail, Windows, per_op_overhead

__all__ = ["Recorder", "Step", "marked_step"]

Step = Callable[[], torch.Tensor]  # runs the forward and returns the scalar loss


class Recorder:
    """The marks of one step: forward/backward start and end of each block (see NOTE [ Profiling rounds ])."""

    def __init__(self, n: int, tracker: Windows | None, timing: bool, devices: tuple[torch.device, ...]) -> None:
        self.n = n
        self.tracker = tracker
        self.timing = timing
        self.devices = devices
        self.owner: tuple[str, int] = ("out", 0)  # the window open now
        self.held_sum = 0  # bytes held by the blocks whose forward ended and backward has not
        self.held = [0] * n
        self.start_level = [0] * n
        self.base = [0] * n  # bytes live at block i's forward start beyond what blocks 0..i-1 hold
        self.peaks: dict[tuple[str, int], int] = {}
        self.times: dict[tuple[str, int], float] = defaultdict(float)
        self.clock = now()
        self.grad_events: dict[int, tuple[weakref.ref[torch.Tensor], list[tuple[int, int]]]] = {}
        self.describe: set[int] = set()  # blocks whose inputs to describe (see alone.py)
        self.specs: dict[int, tuple[Any, Any]] = {}
        self.detailed: set[int] = set()  # blocks to record in detail (NOTE [ Deriving choices ] in derive.py)
        # their forward, and its outputs' storages (weakly: NOTE [ Deriving choices ] in derive.py)
        self.details: dict[int, tuple[Detail, list[tuple[int, weakref.ref[torch.Tensor]]]]] = {}
        self.at_backward: dict[int, tuple[int, int, frozenset[int]]] = {}  # live, own live, outputs live
        self.early: tuple[int, int] | None = None  # at the first backward: bytes the others held, and lost since

    def _switch(self, owner: tuple[str, int]) -> int:
        if self.timing:
            synchronize(self.devices)
            tick = now()
            overhead = self.tracker.take_overhead() if self.tracker is not None else 0.0
            self.times[self.owner] += max(0.0, tick - self.clock - overhead)
        level = 0
        if self.tracker is not None:
            peak = self.tracker.mark()
            level = self.tracker.current_bytes
            kind, k = self.owner
            base = self.held_sum if kind == "out" else self.held_sum - self.held[k]  # S_k: NOTE [ Budget model ]
            self.peaks[self.owner] = max(self.peaks.get(self.owner, 0), peak - base)
        self.owner = owner
        if self.timing:
            self.clock = now()  # what the recorder does between windows counts in none
        return level

    def forward_start(self, i: int) -> None:
        self.start_level[i] = self._switch(("fwd", i))
        self.base[i] = self.start_level[i] - self.held_sum
        if self.tracker is not None and i in self.detailed:
            self.tracker.detail = Detail()

    def forward_end(self, i: int, output: Any) -> None:
        tracker = self.tracker
        if tracker is not None:
            detail = tracker.close()
            self.held[i] = max(0, tracker.current_bytes - self.start_level[i])
            self.held_sum += self.held[i]
            if detail is not None:
                outputs = [(detail.live[k], ref) for k, ref in _storage_keys(output) if k in detail.live]
                self.details[i] = (detail, outputs)
        self._switch(("out", i + 1))

    def backward_start(self, i: int) -> None:
        if self.owner[0] == "bwd" and self.owner[1] > i:  # a block after i never marked its end
            self.backward_end(self.owner[1])
        level = self._switch(("bwd", i))
        if self.tracker is not None and self.early is None and self.details:
            self.early = _early_deaths(self.tracker, [d for j, (d, _) in self.details.items() if j != i])
        if self.tracker is not None and i in self.details:
            detail, out = self.details[i]
            live = frozenset(self.tracker.still_live(detail, [n for n, ref in out if ref() is not None]))
            alive = sum(detail.born[n] for n in self.tracker.still_live(detail, detail.refs))
            self.at_backward[i] = (level - (self.held_sum - self.held[i]), alive, live)
            if self.timing:
                self.clock = now()

    def backward_end(self, i: int) -> None:
        if self.owner != ("bwd", i):
            return
        self._switch(("out", i))
        self.held_sum -= self.held[i]

    def on_grad(self, tensor: torch.Tensor, event: int, i: int) -> None:
        """Call backward_end(i) (event 0) or backward_start(i) (event 1) when `tensor`'s gradient is ready.

        Tensors are held weakly: a strong reference would keep every block's output alive to the end of the step.
        """
        entry = self.grad_events.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            events: list[tuple[int, int]] = []
            entry = (weakref.ref(tensor), events)
            self.grad_events[id(tensor)] = entry

            def hook(grad: torch.Tensor) -> None:
                for kind, block in sorted(events):  # ends before starts: the same tensor ends i and starts i-1
                    (self.backward_end if kind == 0 else self.backward_start)(block)

            tensor.register_hook(hook)  # type: ignore[no-untyped-call]
        entry[1].append((event, i))

    def finish(self) -> None:
        if self.owner[0] == "bwd":
            self.backward_end(self.owner[1])
        self._switch(("out", 0))
        self.grad_events.clear()


def _early_deaths(tracker: Windows, details: list[Detail]) -> tuple[int, int]:
    """Bytes these blocks' forwards left alive, and how many of them died before the first backward started.

    NOTE [ Budget model ] has a block hold what its forward left alive until its own backward; where the
    blocks' storages die sooner (something outside or a later block frees them), the bytes measured above
    S_i depend on the choices around the block, and NOTE [ Deriving choices ] cannot hold.
    """
    held = lost = 0
    for detail in details:
        numbers = list(detail.refs)
        alive = set(tracker.still_live(detail, numbers))
        for number in numbers:
            held += detail.born[number]
            if number not in alive:
                lost += detail.born[number]
    return held, lost


def _storage_keys(value: Any) -> list[tuple[int, weakref.ref[torch.Tensor]]]:
    """The storage key of every tensor in `value` that has a storage, with a weak reference to the tensor."""
    out = []
    for t in tree_leaves(value):
        storage = _storage(t) if isinstance(t, torch.Tensor) else None
        if storage is not None:
            out.append((storage._cdata, weakref.ref(t)))
    return out


def _first_grad_tensor(value: Any) -> torch.Tensor | None:
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return leaf
    return None


def _hooks(blocks: Sequence[nn.Module], recorder: Recorder) -> list[Any]:
    handles: list[Any] = []
    for i, block in enumerate(blocks):

        def pre(module: nn.Module, args: Any, kwargs: Any, i: int = i) -> None:
            if i in recorder.describe:
                recorder.specs[i] = describe(args, kwargs)
            recorder.forward_start(i)
            first = _first_grad_tensor((args, kwargs))
            if first is not None and torch.is_grad_enabled():
                recorder.on_grad(first, 0, i)

        def post(module: nn.Module, args: Any, kwargs: Any, output: Any = None, i: int = i) -> None:
            recorder.forward_end(i, output)
            first = _first_grad_tensor(output)
            if first is not None:
                recorder.on_grad(first, 1, i)

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True, always_call=True))
    return handles


def marked_step(
    step: Step,
    blocks: Sequence[nn.Module],
    tracked: bool,
    timing: bool,
    devices: tuple[torch.device, ...],
    describe: Collection[int] = (),
    detailed: Collection[int] = (),
) -> Recorder:
    """One step with window marks: tracked for bytes, timed, or both (NOTE [ Timing under the tracker ])."""
    with contextlib.ExitStack() as stack:
        tracker: Windows | None = None
        if tracked:
            tracker = Windows()
            stack.enter_context(tracker)
            tracker.per_op = per_op_overhead() if timing else 0.0
        recorder = Recorder(len(blocks), tracker, timing, devices)
        recorder.describe = set(describe)
        recorder.detailed = set(detailed)
        handles = _hooks(blocks, recorder)
        try:
            if timing:
                synchronize(devices)
                if tracker is not None:
                    tracker.take_overhead()
                recorder.clock = now()
            torch.autograd.backward(step())
            recorder.finish()
        finally:
            for handle in handles:
                handle.remove()
    return recorder
