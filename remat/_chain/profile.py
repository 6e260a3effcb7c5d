"""Profiling the stages of a `remat.chain`, and the one way a stage's backward runs (profiled or for real).

`profile` measures every stage on a sample into a `StageCost` (NOTE [ Chain profile ]); `backward_stage`
runs one stage's backward so that autograd frees what it consumes (NOTE [ Backward frees as it goes ]).
Both are used by `remat._chain.chain`, which runs the plans.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._measure.clock import clock_for, now, priced
from .._measure.track import synchronize, track
from .simulate import StageCost

__all__ = ["backward_stage", "check_tensor", "grad_input", "nbytes", "profile", "stage_params"]

# NOTE [ Backward frees as it goes ]
# Plain autograd frees a tensor as soon as nothing needs it: the gradient reaching a node is dropped once
# the node has run, and a node's saved tensors once it has run. torch.autograd.grad(out, wrt, grad) keeps
# `out` and `grad` alive until it returns (the caller's references), so a stage's output and the gradient
# of its output would stay live through the whole backward of the stage, on top of what that backward
# allocates. `backward_stage` starts the backward from a scalar made by `_Seed` from `out` instead: the
# seed's backward hands `grad` to autograd and drops the last reference outside it, so autograd frees the
# gradient once the stage's last node consumed it, and the output once the node that saved it has run
# (checkpoint_sequential and plain autograd free them the same way). Callers pass `[out, grad]` in a list
# that `backward_stage` empties; they must hold no other reference to either. The profile measures each
# stage's backward the same way, so what NOTE [ Memory model ] predicts is what runs.
#
# NOTE [ Chain profile ]
# For stage i with input a_i (x_i bytes): one tracked forward without grad (its peak above its output is a
# temporary of forward_nosave), one tracked forward with grad and its backward in the same tracker.
# saved_bytes (xbar_{i+1}) is what the forward with grad left alive, its output included; forward_temp is
# the larger of the two forwards' peaks above what they leave. The backward starts with xbar_{i+1} and
# delta_{i+1} live; its peak above that, less the x_i bytes of delta_i that the model adds to every
# backward, is backward_temp (never below 0: the model then over-counts by at most x_i, never under).
# Parameters and their gradients are outside the budget (NOTE [ Memory model ]), so that backward asks
# for the input's gradient only (for the parameters' only when the input takes none).
# Times: _TIMINGS passes over the whole chain, each stage's forward and backward timed in every pass, the
# median per stage; a burst of load on the machine spoils one pass, not one stage's every run.

_TIMINGS = 3


class _Seed(torch.autograd.Function):
    """A scalar whose backward hands the stage's output gradient to autograd (NOTE [ Backward frees as it goes ])."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, box: list[torch.Tensor]) -> torch.Tensor:
        ctx.box = box
        return out.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        box, ctx.box = ctx.box, None
        return box.pop(), None


def backward_stage(held: list[torch.Tensor], wrt: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """Gradients of `wrt` from `held = [out, grad]`, emptying `held` so that autograd frees both as it goes."""
    out, grad = held
    held.clear()
    with torch.enable_grad():
        # `apply` is an untyped def up to torch 2.13, an attribute of type Any from 2.14: one ignore for both
        seed: torch.Tensor = _Seed.apply(out, [grad])  # type: ignore[no-untyped-call, unused-ignore]
    del out, grad
    return torch.autograd.grad(seed, wrt, allow_unused=True)


def nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage under `t`."""
    return int(t.untyped_storage().nbytes())


def check_tensor(value: object, where: str) -> torch.Tensor:
    """`value` if it is a tensor; a TypeError naming `where` otherwise."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"remat: chain stages take and return a single tensor, but {where} is "
            f"{type(value).__name__}. Tuples and other structures are not supported by remat.chain; "
            "pack them into one tensor, or use @remat on the stages instead."
        )
    return value


def stage_params(module: nn.Module) -> tuple[torch.Tensor, ...]:
    """The parameters of a stage that need a gradient."""
    return tuple(p for p in module.parameters() if p.requires_grad)


def grad_input(a: torch.Tensor, want: bool) -> torch.Tensor:
    """A detached alias of `a` that requires grad when `want` and `a` is floating."""
    inp = a.detach()
    return inp.requires_grad_() if want and inp.is_floating_point() else inp


def _memory(stage: nn.Module, n: int, a: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """(output, output bytes, saved bytes, forward temp, backward temp) of one stage (NOTE [ Chain profile ])."""
    with torch.no_grad(), track() as plain:
        nxt = check_tensor(stage(a), f"the output of stage {n}")
    out_bytes = nbytes(nxt)
    nosave_temp = max(0, plain.peak_bytes - out_bytes)
    inp = grad_input(a, True)
    # Parameter gradients are outside the budget: only the input's gradient is asked for, if there is one.
    wrt = [inp] if inp.requires_grad else list(stage_params(stage))
    backward_temp = 0
    with track() as t:
        with torch.enable_grad():
            out = check_tensor(stage(inp), f"the output of stage {n}")
        saved = t.current_bytes
        save_temp = max(0, t.peak_bytes - saved)
        if out.requires_grad and wrt:
            held = [out, torch.ones_like(out)]
            del out
            before = t.current_bytes
            t._restart_peak()
            grads = backward_stage(held, wrt)
            backward_temp = max(0, t.peak_bytes - before - nbytes(a))
            del grads
        else:
            del out
    return nxt.detach(), out_bytes, max(saved, out_bytes), max(save_temp, nosave_temp), backward_temp


def profile(stages: Sequence[nn.Module], x: torch.Tensor) -> tuple[list[StageCost], int]:
    """Measure every stage on `x` in turn (NOTE [ Chain profile ]): `StageCost`s and the input's bytes."""
    a = x.detach()
    input_bytes = nbytes(a)
    sizes = []
    for n, stage in enumerate(stages):
        a, *size = _memory(stage, n, a)
        sizes.append(size)
    forward: list[list[float]] = [[] for _ in stages]
    backward: list[list[float]] = [[] for _ in stages]
    with clock_for([x, *(p for stage in stages for p in stage.parameters())]):  # NOTE [ Priced time ]
        _time(stages, x, forward, backward, 1 if priced() else _TIMINGS)  # priced: the same every time
    costs = [
        StageCost(
            forward_time=statistics.median(forward[n]),
            backward_time=statistics.median(backward[n]) if backward[n] else 0.0,
            output_bytes=out_bytes,
            saved_bytes=saved,
            forward_temp=forward_temp,
            backward_temp=backward_temp,
        )
        for n, (out_bytes, saved, forward_temp, backward_temp) in enumerate(sizes)
    ]
    return costs, input_bytes


def _time(stages: Sequence[nn.Module], x: torch.Tensor, forward: list[list[float]], backward: list[list[float]],
          times: int) -> None:
    """Append each stage's forward and backward seconds on `x`'s chain of activations, `times` times over."""
    device = x.device
    for _ in range(times):
        a = x.detach()
        for n, stage in enumerate(stages):
            inp = grad_input(a, True)
            synchronize((device,))
            start = now()
            with torch.enable_grad():
                out = stage(inp)
            synchronize((device,))
            forward[n].append(now() - start)
            a = out.detach()
            wrt = ([inp] if inp.requires_grad else []) + list(stage_params(stage))
            if out.requires_grad and wrt:
                held = [out, torch.ones_like(out)]
                del out
                synchronize((device,))
                start = now()
                backward_stage(held, wrt)
                synchronize((device,))
                backward[n].append(now() - start)
            del inp
