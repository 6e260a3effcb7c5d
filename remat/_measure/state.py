"""A measured step leaves the model as it found it: `.grad`, buffers (BatchNorm statistics) and the RNG streams of
its devices put back.

NOTE [ Buffers a measured step writes ]
1. In the eager steps that check a plan (`measure_step`, the allocator's check: `lazy=True`), a buffer is copied
   before the first op of the step that writes to it (its storage, through any view), and copied back after the
   step; a buffer the step does not write is never copied. So the step holds no copy of buffers that are only read
   (a causal mask's table, rotary frequencies): under `memory=` (NOTE [ Total memory ]) `apply`'s own peak is its
   plan's step's, plus the copies of what that step writes (BatchNorm's statistics).
2. Elsewhere (a profile's steps, a compiled step) every buffer is copied before the step: compiled code writes
   inside kernels that no dispatch mode sees.
3. A buffer replaced rather than written (a new tensor assigned to it) is not put back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._engine.guard import storage_key, written_arguments
from .._engine.modes import Mode
from .._engine.rng import RngStash, devices_of

__all__ = ["step_state"]


class _CopyOnWrite(Mode):
    """Copies a buffer before the first op that writes to it (rule 1)."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        super().__init__()
        self.buffers = {key: b for b in buffers if (key := storage_key(b)) is not None}
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for position, name in written_arguments(func):
            value = args[position] if position < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                self.save(storage_key(value))
        return func(*args, **kwargs)

    def save(self, key: int | None) -> None:
        """A copy of the buffer of storage `key`, where it is one and has none yet."""
        if key is None or key in self.saved or key not in self.buffers:
            return
        buffer = self.buffers[key]
        self.saved[key] = (buffer, buffer.detach().clone())

    def put_back(self) -> None:
        with torch.no_grad():
            for buffer, saved in self.saved.values():
                buffer.copy_(saved)
        self.saved.clear()


@contextlib.contextmanager
def step_state(model: nn.Module, zeros: bool = True, lazy: bool = False) -> Iterator[None]:
    """Inside: every parameter that requires grad has a zero `.grad` (a step accumulates in place, so gradients
    are outside what it measures), or none without `zeros`. After: the parameters' `.grad`, the model's buffers
    and the RNG streams of the devices it is on are as they were (dropout draws the same masks in the steps that
    follow). With `lazy`, for an eager step, only the buffers it writes are copied (NOTE [ Buffers a measured step
    writes ])."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = list(model.buffers())
    copies = _CopyOnWrite(buffers) if buffers else None
    if copies is not None and not lazy:  # rule 2: every buffer, now
        for key in list(copies.buffers):
            copies.save(key)
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if zeros else None
        with RngStash.capture(devices_of(params, module=model)).restore(), (
                copies if copies is not None and lazy else contextlib.nullcontext()):
            yield
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        if copies is not None:
            copies.put_back()
