"""Profiling the stages of a `remat.chain`, and the one way a stage's backward runs (profiled or for real).

`profile_stages` measures every stage on a sample into a `StageCost` (NOTE [ Chain profile ]); `backward_stage`
runs one stage's backward so that autograd frees what it consumes (NOTE [ Backward frees as it goes ]).
Both are used by `remat._chain.chain`, which runs the schedules.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._engine.guard import storage_key
from .._engine.modes import Mode
from .._engine.recorder import op_info
from .._measure.clock import clock_for, now, priced
from .._measure.track import synchronize, track
from .simulate import StageCost

__all__ = ["backward_stage", "check_tensor", "grad_input", "nbytes", "profile_stages", "stage_params", "writer"]

# NOTE [ A stage that changes its input ]
# A chain keeps stage outputs as the inputs of the stages after them (`forward_checkpoint`, `forward_save`) and
# recomputes stages from them: a kept output (NOTE [ A kept output changed in place ] in remat/_engine/kept.py).
# A stage that changes its input in place (`nn.ReLU(inplace=True)` as a stage of its own, `x.mul_(s)` first thing)
# would change that kept tensor, and every recompute from it would start from the changed value.
#
# Rules:
# 1. The profile runs every stage on a copy of its input and sees whether the stage changed it (its version moved).
#    Such a stage is run on a copy of its input wherever the chain runs it (forward, recompute, the profile's own
#    measures, which then count the copy): the kept tensor stays what the stage before made, gradients are exact.
# 2. The profile never changes the caller's sample.
# 3. A stage that changes its input only on inputs other than the sample's is caught where it runs: a clear error
#    naming the stage and the op that changed its input, never a silent difference.

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


def _memory(stage: nn.Module, n: int, a: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int, bool]:
    """(output, output bytes, saved bytes, forward temp, backward temp, whether it changes its input) of one stage
    (NOTE [ Chain profile ], NOTE [ A stage that changes its input ])."""
    trial = a.clone()  # never the caller's sample, nor the input the next measure reads
    with torch.no_grad(), track() as plain:
        nxt = check_tensor(stage(trial), f"the output of stage {n}")
    copied = trial._version != 0
    del trial
    if copied:  # measured again as the chain runs it: on a copy made inside the stage's window
        with torch.no_grad(), track() as plain:
            nxt = check_tensor(stage(a.clone()), f"the output of stage {n}")
    out_bytes = nbytes(nxt)
    nosave_temp = max(0, plain.peak_bytes - out_bytes)
    inp = grad_input(a, True)
    # Parameter gradients are outside the budget: only the input's gradient is asked for, if there is one.
    wrt = [inp] if inp.requires_grad else list(stage_params(stage))
    backward_temp = 0
    with track() as t:
        with torch.enable_grad():
            out = check_tensor(stage(inp.clone() if copied else inp), f"the output of stage {n}")
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
    return nxt.detach(), out_bytes, max(saved, out_bytes), max(save_temp, nosave_temp), backward_temp, copied


def profile_stages(stages: Sequence[nn.Module], x: torch.Tensor) -> tuple[list[StageCost], int, frozenset[int]]:
    """Measure every stage on `x` in turn (NOTE [ Chain profile ]): `StageCost`s, the input's bytes, and the stages
    that change their input in place, which the chain runs on a copy of it (NOTE [ A stage that changes its
    input ])."""
    a = x.detach()
    input_bytes = nbytes(a)
    sizes = []
    copies: set[int] = set()
    for n, stage in enumerate(stages):
        a, *size, copied = _memory(stage, n, a)
        sizes.append(size)
        if copied:
            copies.add(n)
    forward: list[list[float]] = [[] for _ in stages]
    backward: list[list[float]] = [[] for _ in stages]
    with clock_for([x, *(p for stage in stages for p in stage.parameters())]):  # NOTE [ Priced time ]
        _time(stages, x, forward, backward, 1 if priced() else _TIMINGS, copies)  # priced: the same every time
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
    return costs, input_bytes, frozenset(copies)


def _time(stages: Sequence[nn.Module], x: torch.Tensor, forward: list[list[float]], backward: list[list[float]],
          times: int, copies: set[int]) -> None:
    """Append each stage's forward and backward seconds on `x`'s chain of activations, `times` times over; the
    stages of `copies` on a copy of their input."""
    device = x.device
    for _ in range(times):
        a = x.detach()
        for n, stage in enumerate(stages):
            inp = grad_input(a, True)
            synchronize((device,))
            start = now()
            with torch.enable_grad():
                out = stage(inp.clone() if n in copies else inp)
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


class _FirstWrite(Mode):
    """Notes the first op that writes into the memory of `tensor`."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.key = storage_key(tensor)
        self.found: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.found is None and self.key is not None:
            for position, name in op_info(func).writes:
                value = args[position] if position < len(args) else (kwargs or {}).get(name)
                if isinstance(value, torch.Tensor) and storage_key(value) == self.key:
                    self.found = str(func)
        return func(*args, **(kwargs or {}))


def writer(stage: nn.Module, a: torch.Tensor) -> str | None:
    """The first op of `stage` that writes into its input, run on a copy of `a` without grad (for an error message:
    NOTE [ A stage that changes its input ], rule 3); None where none does."""
    copy = a.detach().clone()
    mode = _FirstWrite(copy)
    with torch.no_grad(), mode:
        stage(copy)
    return mode.found
