"""Measure one training step of a function or module: `remat.measure`.

NOTE [ Held for backward ]
1. "Held for backward" is the bytes of the storages allocated during forward that are still alive once forward has
   returned, less the storages of the output: what autograd keeps (saved activations, remat's saved inputs and
   handles) plus anything the function stashed elsewhere (caches, module attributes).
2. Tensors created before the call (inputs, parameters) are not counted, even when autograd saves them.
3. An output that is a view of a saved activation makes that activation's storage count as output: it is left out.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._core.public import claim
from .._core.switch import enabled
from .._core.torch_compat import tree_leaves
from .._engine import stats as _stats
from .._engine.rng import RngStash, devices_of
from .loss import default_loss
from .measurement import Measurement, Report
from .track import synchronize, track

__all__ = ["measure"]


def _name(target: object) -> str:
    if isinstance(target, nn.Module):
        return type(target).__name__
    return str(getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target)))


def _loss(out: object) -> torch.Tensor:
    """The scalar to back-propagate: `default_loss` (the output's `.loss`, else the sum of its floating tensors)."""
    try:
        value: torch.Tensor | None = default_loss(out)
    except TypeError:
        value = None
    if value is None or not value.requires_grad:
        raise ValueError(
            "remat: measure needs an output with a floating-point tensor that requires grad, "
            f"but got `{type(out).__name__}` with none; pass inputs or parameters that require grad."
        )
    return value


def _leaves(obj: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def _fresh_grads(leaves: list[torch.Tensor]) -> Iterator[None]:
    """Run with ``.grad`` of ``leaves`` set to None, and put back what was there."""
    saved = [t.grad for t in leaves]
    try:
        for t in leaves:
            t.grad = None
        yield
    finally:
        for t, g in zip(leaves, saved, strict=True):
            t.grad = g


def _measure_once(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    label: str,
    devices: set[torch.device],
) -> Measurement:
    synchronize(devices)
    with track() as t:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        synchronize(devices)
        forward = time.perf_counter() - start
        own = t.bytes_of(_leaves(out))
        held = {d: t.current(d) - own.get(d, 0) for d in t.devices}
        loss = _loss(out)
        recompute_before = _stats.recompute_seconds
        start = time.perf_counter()
        torch.autograd.backward(loss)
        synchronize(devices)
        backward = time.perf_counter() - start
        recompute_after = _stats.recompute_seconds
        del out, loss
    recompute = recompute_after - recompute_before
    return Measurement(
        label=label,
        peak_bytes=t.peak_bytes,
        held_bytes=sum(held.values()),
        peak_by_device={str(d): t.peak(d) for d in t.devices},
        held_by_device={str(d): n for d, n in held.items()},
        forward_seconds=forward,
        backward_seconds=backward,
        recompute_seconds=recompute,
    )


def measure(fn_or_module: Callable[..., Any], *args: Any, compare: bool = False, **kwargs: Any) -> Report:
    """Run one forward and backward of ``fn_or_module(*args, **kwargs)`` and measure it.

    Backward starts from the output if it is a scalar, else from the sum of ``t.sum()`` over its
    floating-point tensors that require grad. Memory is counted with `remat.track` (live storage
    bytes per device, exact on CPU); tensors that exist before the call, such as inputs and
    parameters, are not counted, gradients made by the backward are: the peak is the step peak, what
    a budget bounds, and forward's leftovers are the bytes held for backward. The ``.grad`` of parameters
    and of inputs is set aside during the measurement and put back afterwards, so the gradients
    of the measured step are not kept. Times include the tracker's cost, some Python on every aten
    op; for precise step times use the benchmark, ``python -m benchmarks``.

    Args:
        fn_or_module: A function or module to call.
        *args: Positional arguments for the call.
        compare: Also run with remat switched off (``remat.enabled(False)``) and show both, with
            their ratios. Each side runs once to warm up, then three times, interleaved with the
            other side; times are medians. Every run starts from the same RNG state, so dropout
            masks match, and from the same buffers (BatchNorm statistics), which end up updated
            once. The report says so when no remat site rebuilt anything.
        **kwargs: Keyword arguments for the call.

    Returns:
        A `Report`; ``print(report)`` shows a table, ``report.to_dict()`` the numbers.

    Raises:
        ValueError: The output has no floating-point tensor that requires grad.

    Example:
        >>> import torch, remat
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
        ...                           torch.nn.Linear(256, 64))
        >>> report = remat.measure(mlp, torch.randn(32, 64))
        >>> report.held_bytes  # ReLU's output, saved by ReLU and by the second Linear
        32768
    """
    if not callable(fn_or_module):
        raise TypeError(f"remat: measure expects a function or module, but got `{type(fn_or_module).__name__}`.")
    inputs = _leaves((args, kwargs))
    params = list(fn_or_module.parameters()) if isinstance(fn_or_module, nn.Module) else []
    grad_leaves = [t for t in (*inputs, *params) if t.requires_grad and t.is_leaf]
    module = fn_or_module if isinstance(fn_or_module, nn.Module) else None
    devices = set(devices_of(inputs, module))
    name = _name(fn_or_module)
    with _fresh_grads(grad_leaves):
        if not compare:
            return Report(name, (_measure_once(fn_or_module, args, kwargs, "as is", devices),))
        return _compare(fn_or_module, args, kwargs, name, devices, grad_leaves)


COMPARE_REPEATS = 3
"""Measured runs per side with ``compare=True``, after one warm-up run each."""


def _compare(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    name: str,
    devices: set[torch.device],
    grad_leaves: list[torch.Tensor],
) -> Report:
    """Remat on and off: one warm-up run each, then `COMPARE_REPEATS` of each, interleaved; median times.

    A first call pays for warm-up (allocator growth, lazy initialisation, caches) that later calls do not,
    so measuring one side once and then the other once charges it all to the first. Every run starts
    from the same RNG state and the same buffer values; after the last one, buffers are updated once.
    """
    module = fn if isinstance(fn, nn.Module) else None
    buffers = [b.detach().clone() for b in module.buffers()] if module is not None else []
    stash = RngStash.capture(devices)
    order = [True, False]  # the warm-up pair, then pairs in alternating order, so neither side is always first
    for i in range(COMPARE_REPEATS):
        order += [True, False] if i % 2 == 0 else [False, True]
    runs: dict[bool, list[Measurement]] = {True: [], False: []}
    recomputes = 0
    for i, on in enumerate(order):
        if module is not None:
            with torch.no_grad():
                for b, old in zip(module.buffers(), buffers, strict=True):
                    b.copy_(old)
        for t in grad_leaves:
            t.grad = None
        before = _stats.recomputes
        with contextlib.ExitStack() as stack:
            if i < len(order) - 1:
                stack.enter_context(stash.restore())  # put the caller's RNG state back after this run
            else:
                stash.apply()  # the last run leaves the generators as one step would
            stack.enter_context(enabled(on))
            m = _measure_once(fn, args, kwargs, "remat on" if on else "remat off", devices)
        if on:
            recomputes += _stats.recomputes - before
        if i >= 2:  # not a warm-up run
            runs[on].append(m)
    notes = [
        f"times: median of {COMPARE_REPEATS} runs per side, interleaved, after one warm-up run each; "
        "bytes: the last run."
    ]
    if recomputes == 0:
        notes.append(
            "remat rebuilt nothing in backward: no remat site ran in this model (or every site kept what it saved), "
            "so both sides run the same code and differ only by noise."
        )
    return Report(name, (_median_run(runs[True]), _median_run(runs[False])), tuple(notes))


def _median_run(runs: list[Measurement]) -> Measurement:
    """The last run's bytes with the median of each time."""
    last = runs[-1]
    recompute = [r.recompute_seconds for r in runs if r.recompute_seconds is not None]
    return Measurement(
        label=last.label,
        peak_bytes=last.peak_bytes,
        held_bytes=last.held_bytes,
        peak_by_device=last.peak_by_device,
        held_by_device=last.held_by_device,
        forward_seconds=statistics.median(r.forward_seconds for r in runs),
        backward_seconds=statistics.median(r.backward_seconds for r in runs),
        recompute_seconds=statistics.median(recompute) if recompute else None,
    )

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
