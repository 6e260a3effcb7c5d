"""Where a training step peaks (forward, backward, the optimizer step) and which modules hold the bytes there.

NOTE [ Who holds the peak ]
`PhaseTracker` is the estimate's fake tracker with two more records. Each storage is labelled, when it is made,
with the innermost module of the model whose forward is running (module-wide forward hooks keep the stack, so
a block recomputed in backward labels what it rebuilds with its own name); what is made outside every module
is labelled by the phase (the loss in forward; gradients and temporaries in backward). Whenever the live bytes
reach a new high within a phase, the live bytes per label are copied: after the step they say what was alive at
each phase's highest point. The optimizer step runs once for all configurations (NOTE
[ One optimizer step ] in predict.py); what is alive at its peak is the state, every gradient and the
step's temporaries, which `optimizer_holders` attributes to the modules owning the parameters. Names of
repeated blocks are folded (``layers.0.mlp`` … ``layers.31.mlp`` -> ``layers.*.mlp (32x)``; the first index in
a name only) so that a few lines say where the bytes are.

Implementation notes:
1. The bytes per label are copied at a phase's highest point lazily: a new high only marks the copy as due, and
   it is taken before the next storage is released or shrunk (or the phase ends). Until then only allocations
   happen, each of which is a new high again, so the copy holds what was alive at the highest point, as an eager
   copy at each new high would, for one copy per stretch of allocations rather than one per allocation.
2. Given the container of the model's identical layers (NOTE [ Searching the largest batch ], rule 6), backward's
   peak is also kept in parts, split where backward reaches the outputs of the last layer, the second-to-last and
   the first (hooks on those outputs, set in forward): backward up to the last layer's, the last layer's, the
   layers between, and the first layer's on. These are the search's, not the report's.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from .._core.torch_compat import tree_leaves
from .._core.units import format_bytes
from .._measure.fake import FakeTracker, storage_bytes

__all__ = [
    "BACKWARD", "BETWEEN", "FIRST_LAYER", "FORWARD", "HEAD", "LAST_LAYER", "OPTIMIZER", "PhaseTracker", "fold",
    "optimizer_holders", "peak_lines", "where_it_peaks",
]

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer step"
HEAD, LAST_LAYER = "backward to the last layer", "backward of the last layer"
BETWEEN, FIRST_LAYER = "backward between", "backward from the first layer on"
"""The parts of backward split at the identical layers (implementation note 2)."""
OUTSIDE = {FORWARD: "(loss, outside modules)", BACKWARD: "(gradients, backward temporaries)"}
TOP = 5
"""How many holders a report names."""


class PhaseTracker(FakeTracker):
    """A `FakeTracker` that labels storages by module and keeps the bytes per label at the peak on ``device``."""

    _sees_devices = False  # bytes only: autograd asks each fake tensor's device many times a step

    def __init__(self, model: nn.Module, device: torch.device, layers: nn.Module | None = None) -> None:
        super().__init__()
        self._layers = layers  # the container of the model's identical layers, to split backward at (note 2)
        self._due = False  # a copy of the bytes per label at the phase's highest point is due (note 1)
        self._part: str | None = None
        self.part_peaks: dict[str, int] = {}  # backward's parts (note 2): part -> its peak
        self.device = device
        self.phase = FORWARD
        self._names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        self._stack: list[str] = []
        self._labels: dict[int, str] = {}
        self._held: dict[str, int] = {}
        self.phase_peaks: dict[str, int] = {}
        self._at_peak: dict[str, dict[str, int]] = {}

    @property
    def at_peak(self) -> dict[str, dict[str, int]]:
        """Phase -> label -> bytes alive at the phase's peak."""
        with self._lock:
            self._copy()
        return self._at_peak

    def __enter__(self) -> PhaseTracker:
        super().__enter__()
        return self

    @contextmanager
    def modules(self) -> Iterator[None]:
        """Keep the stack of running modules of the model while inside (module-wide hooks, removed on exit)."""

        splits: dict[int, str] = {}  # id of a layer -> the part of backward that starts at its output's gradient
        if self._layers is not None:
            layers = list(self._layers.children())
            if len(layers) >= 2:
                splits[id(layers[-1])] = LAST_LAYER
                splits[id(layers[-2])] = BETWEEN
                splits[id(layers[0])] = FIRST_LAYER

        def push(module: nn.Module, args: Any) -> None:
            name = self._names.get(id(module))
            if name is not None:
                self._stack.append(name)

        def pop(module: nn.Module, args: Any, out: Any) -> None:
            name = self._names.get(id(module))
            if name is not None and self._stack and self._stack[-1] == name:
                self._stack.pop()
            part = splits.get(id(module))
            if part is not None and self.phase == FORWARD:
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(functools.partial(self._begin, part))  # type: ignore[no-untyped-call]
                        break

        handles = [register_module_forward_pre_hook(push), register_module_forward_hook(pop)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._stack.clear()

    def enter(self, phase: str) -> None:
        """Start ``phase``: the stack starts empty (a failed forward leaves nothing behind)."""
        with self._lock:
            self._copy()
            self.phase = phase
        self._stack.clear()
        self._begin(HEAD if phase == BACKWARD and self._layers is not None else None)

    def _begin(self, part: str | None, grad: object = None) -> None:
        """Start a part of backward (note 2): its peak starts at the bytes live now."""
        with self._lock:
            self._part = part
            if part is not None:
                self.part_peaks[part] = max(self.part_peaks.get(part, 0), self._current.get(self.device, 0))

    def _add(self, key: int, t: torch.Tensor, st: torch.UntypedStorage) -> None:
        label = self._stack[-1] if self._stack else OUTSIDE.get(self.phase, self.phase)
        super()._add(key, t, st)
        entry = self._live.get(key)
        if entry is None or entry[0] != self.device:
            return
        with self._lock:
            self._labels[key] = label
            self._held[label] = self._held.get(label, 0) + entry[1]
            self._mark()

    def _resize(self, key: int, nbytes: int) -> None:
        before = self._live.get(key)
        if before is not None and nbytes < before[1]:
            with self._lock:
                self._copy()
        super()._resize(key, nbytes)
        label = self._labels.get(key)
        if before is not None and label is not None:
            with self._lock:
                self._held[label] = self._held.get(label, 0) + nbytes - before[1]
                self._mark()

    def _release(self, key: int, ref: object = None) -> None:
        entry = self._live.get(key)
        with self._lock:
            self._copy()
        super()._release(key, ref)
        with self._lock:
            label = self._labels.pop(key, None)
            if label is not None and entry is not None:
                self._held[label] = self._held.get(label, 0) - entry[1]

    def _mark(self) -> None:
        # Called with the lock held, after an allocation on the device.
        now = self._current.get(self.device, 0)
        if now > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = now
            self._due = True
        part = self._part
        if part is not None and now > self.part_peaks.get(part, -1):
            self.part_peaks[part] = now

    def _copy(self) -> None:
        # Called with the lock held: the copy of the bytes per label at the phase's peak, where one is due (note 1).
        if self._due:
            self._due = False
            self._at_peak[self.phase] = {label: n for label, n in self._held.items() if n > 0}


def fold(held: Mapping[str, int], top: int = TOP) -> tuple[tuple[str, int], ...]:
    """The ``top`` largest holders, repeated blocks folded into one line (``layers.*.mlp (32x)``)."""
    groups: dict[str, list[int]] = {}
    for name, n in held.items():
        groups.setdefault(re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name, count=1), []).append(n)
    rows = [(name if len(ns) == 1 else f"{name} ({len(ns)}x)", sum(ns)) for name, ns in groups.items()]
    rows.sort(key=lambda row: -row[1])
    return tuple(rows[:top])


def optimizer_holders(model: nn.Module, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
                      device: torch.device) -> dict[str, int]:
    """Bytes of each module's parameters, their gradients and their optimizer state (alive at the optimizer step)."""
    owners: dict[int, str] = {}
    for name, module in model.named_modules():
        for p in module._parameters.values():
            if p is not None and id(p) not in owners:
                owners[id(p)] = name or type(model).__name__
    held: dict[str, int] = {}
    for p in params:
        if not p.requires_grad:
            continue
        state = [t for t in optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
        own = storage_bytes([p], device)
        name = owners.get(id(p), "(parameters)")
        held[name] = held.get(name, 0) + 2 * own + storage_bytes(state, device)  # the parameter, its gradient
    return held


def where_it_peaks(tracker: PhaseTracker, base: int, model: nn.Module, params: Sequence[torch.Tensor],
                   optimizer: torch.optim.Optimizer | None,
                   step_bytes: Sequence[int]) -> tuple[str, dict[str, int], tuple[tuple[str, int], ...]]:
    """The phase of the step's peak, the peak bytes of each phase (``base``, the state alive throughout, added),
    and the largest holders at the peak: what forward/backward made, or at the optimizer step, each module's
    parameters, gradients and state, and the step's temporaries."""
    phases = {phase: base + tracker.phase_peaks.get(phase, 0) for phase in (FORWARD, BACKWARD)}
    if optimizer is not None:
        phases[OPTIMIZER] = base + tracker.phase_peaks.get(OPTIMIZER, 0)
    phase = max(phases, key=lambda name: phases[name])  # a tie goes to the earlier phase
    if phase == OPTIMIZER and optimizer is not None:
        held = optimizer_holders(model, params, optimizer, tracker.device)
        held["(optimizer step temporaries)"] = sum(step_bytes)
    else:
        held = dict(tracker.at_peak.get(phase, {}))
    return phase, phases, fold(held)


def peak_lines(rows: Sequence[Any], memory: int | None, headroom: int = 0,
               positions: tuple[str, int] | None = None) -> list[str]:
    """The lines under an estimate's table: where each configuration peaks and who holds the bytes there, what
    remat frees when the optimizer step sets the peak, what holding on to the model's output adds, which
    configurations were refused, and the largest batches that fit in ``memory``."""
    lines: list[str] = []
    met = [row for row in rows if row.refused is None]
    if met and all(row.peak_phase == OPTIMIZER for row in met):
        frees = ", ".join(f"{row.label} {format_bytes(row.activation_bytes)}" for row in met)
        lines.append(f"the optimizer step sets the peak under every configuration ({format_bytes(met[0].peak_bytes)})"
                     f", and remat does not lower it: remat frees activations, the bytes held for backward ({frees}); "
                     "the memory they free goes to a larger batch (memory=, batch_dim=)")
    same = len({(row.peak_phase, row.holders) for row in met}) == 1
    for row in met[:1] if same else met:
        if row.holders:
            held = ", ".join(f"{name} {format_bytes(n)}" for name, n in row.holders)
            label = "every configuration" if same and len(met) > 1 else row.label
            lines.append(f"{label}: peaks in {row.peak_phase or '?'}; largest holders there: {held}")
    output = max((row.output_bytes for row in met), default=0)
    if output > 0:
        lines.append(f"the model's output ({format_bytes(output)}) is let go of before backward, as `loss = "
                     f"model(batch).loss` does; a loop that keeps it through backward peaks up to "
                     f"{format_bytes(output)} higher")
    for row in rows:
        if row.refused is not None:
            least = f": the least budget it meets is {format_bytes(row.least_bytes)}" if row.least_bytes else ""
            lines.append(f"{row.label}: refused on this sample{least}")
    if memory is not None:
        for row in rows:
            room = f" ({format_bytes(headroom)} left to the allocator)" if headroom else ""
            beyond = ""
            if positions is not None and row.largest_seq is not None and row.largest_seq > positions[1]:
                beyond = (f" (more than the {positions[1]} positions `{positions[0]}` holds: the model takes at "
                          f"most {positions[1]})")
            if row.largest_batch == 0 and not row.largest_seq:  # not one sample: say so, not "0"
                lines.append(f"{row.label}: nothing fits in {format_bytes(memory)}{room}, not even a batch of 1 "
                             f"(its device peak at the sample: {format_bytes(row.peak_bytes)})")
            elif row.largest_batch is not None:
                seq = f", sequence length {row.largest_seq}{beyond}" if row.largest_seq is not None else ""
                fits = f"largest batch that fits in {format_bytes(memory)}{room}"
                lines.append(f"{row.label}: {fits}: {row.largest_batch}{seq}")
            elif row.largest_seq is not None:
                lines.append(f"{row.label}: longest sequence that fits in {format_bytes(memory)}{room} at the "
                             f"sample's batch size: {row.largest_seq}{beyond}")
    return lines
