"""A measured step leaves the model as it found it: `.grad`, buffers (BatchNorm statistics) and the RNG streams of
its devices put back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .._engine.rng import RngStash, devices_of

__all__ = ["step_state"]


@contextlib.contextmanager
def step_state(model: nn.Module, zeros: bool = True) -> Iterator[None]:
    """Inside: every parameter that requires grad has a zero `.grad` (a step accumulates in place, so gradients
    are outside what it measures), or none without `zeros`. After: the parameters' `.grad`, the model's buffers and
    the RNG streams of the devices it is on are as they were (dropout draws the same masks in the steps that
    follow)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if zeros else None
        with RngStash.capture(devices_of(params, module=model)).restore():
            yield
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
