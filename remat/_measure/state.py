"""A measured step leaves the model as it found it: `.grad` and buffers (BatchNorm statistics) put back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["step_state"]


@contextlib.contextmanager
def step_state(model: nn.Module) -> Iterator[None]:
    """Inside: every parameter that requires grad has a zero `.grad` (a step accumulates in place, so gradients
    are outside what it measures). After: the parameters' `.grad` and the model's buffers are as they were."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        yield
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
