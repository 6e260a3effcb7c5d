"""Runs of one block alone, on fresh inputs shaped like the ones it saw in a profiled step: its time without the
tracker (NOTE [ Timing under the tracker ] in profile_step.py), what a dispatch mode costs on its own ops (NOTE
[ Mode cost in place ] in costs_derived.py), and its bytes in eager and in compiled code (NOTE [ Compiled bytes ] in
costs_compiled.py).

Rules:
1. The profiled step keeps no input of a block alive, only its description (`describe_args`): what the tracker measures
   after the block is the step's own.
2. A run alone makes fresh inputs from the description: random values of the same shape, dtype and device for a
   floating tensor (a block's time and bytes do not depend on the values); any other argument (integer or boolean
   tensors such as masks and positions, other objects) is held weakly and is the very object while it lives, else
   zeros of its shape and dtype for a tensor, None for another object.

Implementation notes:
1. (rule 1) A mask the model makes inside the step, or a Hugging Face cache object (which the layers fill with every
   key and value of the step), would otherwise live through the profiled step and count in every byte measured
   after it (docs/benchmarks.md, "Figures behind the design notes").
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._core.torch_compat import can_record_host, compiling_allowed, host_bytes, tree_leaves, tree_map
from .._measure.clock import now
from .._measure.track import synchronize

__all__ = ["Shift", "bytes_alone", "compiled_shifts", "describe_args", "mode_alone", "time_alone"]


@dataclass(frozen=True)
class _Like:
    """A floating tensor to make again: its shape, dtype, device and whether it requires grad."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


@dataclass(frozen=True)
class _Weak:
    """Any other argument, held weakly; what stands in for it once it is dead (rule 2)."""

    ref: weakref.ref[Any]
    like: _Like | None  # for a tensor: zeros of its shape and dtype; else None


def describe_args(args: Any, kwargs: Any) -> tuple[Any, Any]:
    """A block call's arguments with every floating tensor replaced by its description, the rest held weakly.

    >>> describe_args((torch.zeros(2, 3), 4), {})
    ((_Like(shape=(2, 3), dtype=torch.float32, device=device(type='cpu'), requires_grad=False), 4), {})
    """

    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            like = _Like(tuple(x.shape), x.dtype, x.device, x.requires_grad)
            return like if x.is_floating_point() else _Weak(weakref.ref(x), like)
        try:
            return _Weak(weakref.ref(x), None)
        except TypeError:  # None, numbers, strings, dtypes: nothing to keep alive
            return x

    return tree_map(one, (args, kwargs))  # type: ignore[no-any-return]


def _make(spec: tuple[Any, Any]) -> tuple[Any, Any]:
    def one(x: Any) -> Any:
        if isinstance(x, _Like):
            return torch.randn(x.shape, dtype=x.dtype, device=x.device).requires_grad_(x.requires_grad)
        if isinstance(x, _Weak):
            alive = x.ref()
            if alive is not None or x.like is None:
                return alive
            return torch.zeros(x.like.shape, dtype=x.like.dtype, device=x.like.device)
        return x

    return tree_map(one, spec, is_leaf=lambda x: isinstance(x, (_Like, _Weak)))  # type: ignore[no-any-return]


def _sums(out: Any) -> list[torch.Tensor]:
    """What backward starts from: the sum of each output that requires grad. Sums rather than explicit gradients:
    torch.autograd.backward checks explicit ones with a module whose first import (sympy) is slow.
    The gradient of a sum is ones."""
    return [t.sum() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def time_alone(block: nn.Module, spec: tuple[Any, Any], devices: Sequence[torch.device]) -> tuple[float, float]:
    """Seconds of `block`'s forward and of its backward (ones as output gradients), run once on fresh inputs.

    >>> fwd, bwd = time_alone(nn.Linear(4, 4), describe_args((torch.ones(2, 4),), {}), [])
    >>> fwd > 0 and bwd > 0
    True
    """
    args, kwargs = _make(spec)
    synchronize(devices)
    start = now()
    out = block(*args, **kwargs)
    synchronize(devices)
    forward = now() - start
    sums = _sums(out)
    synchronize(devices)
    start = now()
    if sums:
        torch.autograd.backward(sums)
    synchronize(devices)
    return forward, now() - start


def bytes_alone(run: Callable[..., Any], spec: tuple[Any, Any]) -> tuple[int, int, int] | None:
    """Bytes held after forward, forward peak and backward peak (ones as output gradients) of one call of `run` on
    fresh inputs, above what was live before it, read from the CPU allocator (`host_bytes`: compiled code's
    buffers included); None where this torch cannot record allocations."""
    args, kwargs = _make(spec)
    out: list[Any] = []
    forward = host_bytes(lambda: out.append(run(*args, **kwargs)))
    sums = _sums(out)
    backward = host_bytes(lambda: torch.autograd.backward(sums) if sums else None)
    if forward is None or backward is None:
        return None
    return forward[1], forward[0], forward[1] + backward[0]


def mode_alone(
    block: nn.Module, spec: tuple[Any, Any], devices: Sequence[torch.device], mode: Callable[[], Any], tries: int = 2
) -> float:
    """Seconds that running under `mode()` adds to one forward of `block` on fresh inputs (the least of `tries`
    runs each way, never below zero): what a dispatch mode costs on this block's own ops, whose arguments make
    it dearer than on the small ops `mode_cost` calibrates with (NOTE [ Mode cost in place ] in costs_derived.py).

    >>> from remat._engine.selective import SaveOps
    >>> from remat.policies import save_matmuls
    >>> mode_alone(nn.Linear(4, 4), describe_args((torch.ones(2, 4),), {}), [], lambda: SaveOps(save_matmuls)) >= 0
    True
    """
    args, kwargs = _make(spec)

    def once(under: bool) -> float:
        synchronize(devices)
        start = now()
        if under:
            with mode():
                block(*args, **kwargs)
        else:
            block(*args, **kwargs)
        synchronize(devices)
        return now() - start

    bare = min(once(False) for _ in range(tries))
    return max(0.0, min(once(True) for _ in range(tries)) - bare)


Shift = tuple[int, int, int]  # bytes compiling adds to a block's held bytes, forward peak and backward peak


def compiled_shifts(
    block: nn.Module, spec: tuple[Any, Any], choices: Sequence[int], assign: Callable[[int], None]
) -> dict[int, Shift]:
    """Per choice, what compiling `block` adds to its bytes (NOTE [ Compiled bytes ] in costs_compiled.py); empty where
    it cannot tell.

    Args:
        spec: its inputs in the profiled step (`describe_args`).
        choices: the choices to measure (each is put on `block` with `assign`; kept is put back after).
    """
    if any(p.device.type != "cpu" for p in block.parameters()) or not can_record_host():
        return {}
    compiled = torch.compile(block)
    shifts: dict[int, Shift] = {}
    try:
        for c in choices:
            assign(c)
            eager = bytes_alone(block, spec)
            with compiling_allowed():
                bytes_alone(compiled, spec)  # compiles: what the compiler allocates is not the block's
                fused = bytes_alone(compiled, spec)
            if eager is None or fused is None:
                return {}
            shifts[c] = (fused[0] - eager[0], fused[1] - eager[1], fused[2] - eager[2])
    finally:
        assign(0)
    return shifts
