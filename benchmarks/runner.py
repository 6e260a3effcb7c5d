"""Running rows: one warm-up step, one tracked step for memory and gradients, interleaved timed repeats."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch

from remat._demo import CONVNET_SIZES, GPT, GPT_SIZES, BenchModel, ConvNet
from remat._measure.track import synchronize as _sync
from remat._measure.track import track

from .configs import NO_REMAT, SEED, TORCH, Config

__all__ = [
    "GRAD_BOUND", "MODELS", "STEPS_PER_REPEAT", "TINY_ROUNDS", "Progress", "Result", "bench_model", "bench_tiny",
    "check_grads", "fail", "note", "sync", "tiny", "tiny_input",
]

sync = _sync

# -- results -------------------------------------------------------------------------------------


@dataclass
class Result:
    """One row of the table: a configuration measured on a model.

    ``step_seconds`` holds every timed repeat (per call for the tiny function); ``step`` is
    their median.
    """

    model: str
    config: str
    peak_bytes: int | None = None
    held_bytes: int | None = None
    step_seconds: list[float] = field(default_factory=list)
    grad_diff: float | None = None
    note: str = ""
    compare: bool = True  # whether ratios to the no-remat and torch rows make sense
    error: str = ""  # why the row failed (its call raised, or its gradients are off): `python -m benchmarks` exits 1
    traffic: dict[str, int | None] | None = None  # offload rows: the step's copies between device and host
    profile: dict[str, Any] | None = None  # offload rows: one step under torch.profiler (benchmarks/offload.py)

    @property
    def step(self) -> float | None:
        """Median step time in seconds, or None when the row did not run."""
        return statistics.median(self.step_seconds) if self.step_seconds else None

    def to_dict(self) -> dict[str, Any]:
        """Return the row as plain JSON-ready values, with the median step time."""
        return {**asdict(self), "step_median_seconds": self.step}


# -- progress ------------------------------------------------------------------------------------


class Progress:
    """One status line on stderr, rewritten in place on a terminal."""

    def __init__(self, stream: TextIO, quiet: bool) -> None:
        self.stream, self.quiet = stream, quiet
        self.tty = stream.isatty()
        self.width = 0
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.quiet:
            return
        line = f"[{time.perf_counter() - self.start:5.1f} s] {message}"
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


# -- the tiny function of the overhead rows ------------------------------------------------------


def tiny(x: torch.Tensor) -> torch.Tensor:
    """Two cheap elementwise ops: what per-call overhead is measured on.

    Example:
        >>> import torch
        >>> from benchmarks.runner import tiny
        >>> tiny(torch.zeros(2))
        tensor([0., 0.])
    """
    return (x * 2).sin()


def tiny_input(device: torch.device) -> torch.Tensor:
    """A small input for `tiny` that requires grad."""
    return torch.randn(16, device=device).requires_grad_()


# -- running -------------------------------------------------------------------------------------


def note(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) <= 60 else text[:57] + "..."


def _timed_step(model: BenchModel, batch: Sequence[torch.Tensor], device: torch.device) -> float:
    for p in model.parameters():
        p.grad = None
    devices = {device}
    _sync(devices)
    start = time.perf_counter()
    loss = model.loss(*batch)
    torch.autograd.backward(loss)
    _sync(devices)
    return time.perf_counter() - start


def _tracked_step(model: BenchModel, batch: Sequence[torch.Tensor]) -> tuple[int, int, list[torch.Tensor]]:
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)  # see NOTE [ What the memory columns count ]
    torch.manual_seed(SEED)
    with track() as t:
        loss = model.loss(*batch)
        held = t.current_bytes - sum(t.bytes_of([loss]).values())
        torch.autograd.backward(loss)
        del loss
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    return t.peak_bytes, held, grads


def _max_diff(grads: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    return max((float((g - r).abs().max()) for g, r in zip(grads, reference, strict=True) if g.numel()), default=0.0)


GRAD_BOUND = 1e-4
"""The largest difference from no remat's gradients a row may show, as a fraction of the largest of them (at
least 1): remat recomputes with the same kernels and RNG, so in float32 only summation order may differ."""


def fail(result: Result, why: str) -> None:
    """Mark `result` failed: the table shows `why`, and `python -m benchmarks` exits with status 1."""
    result.error = why
    result.note = f"FAILED: {why}"


def check_grads(result: Result, diff: float, reference: Sequence[torch.Tensor]) -> None:
    """Record `diff` (the largest gradient difference from no remat) and fail the row past `GRAD_BOUND`."""
    result.grad_diff = diff
    scale = max((float(r.abs().max()) for r in reference if r.numel()), default=0.0)
    bound = GRAD_BOUND * max(1.0, scale)
    if not diff <= bound:  # also NaN
        fail(result, f"gradients differ from no remat's by {diff:.1e} (bound {bound:.1e})")


MODELS: dict[str, Callable[[str], BenchModel]] = {
    "gpt": lambda size: GPT(GPT_SIZES[size]),
    "convnet": lambda size: ConvNet(CONVNET_SIZES[size]),
}


STEPS_PER_REPEAT = 2
"""A repeat times this many consecutive steps of one configuration and keeps the fastest: what another process
does to one step (a burst of load on a shared machine) does not become that repeat's time."""
TINY_ROUNDS = 5
"""Rounds per repeat for the tiny function, interleaved across configurations (see `bench_tiny`)."""


def bench_model(
    name: str,
    base: BenchModel,
    device: torch.device,
    repeats: int,
    configs: Sequence[Config],
    progress: Callable[[str], None],
) -> list[Result]:
    base.to(device).train()
    batch = base.sample(device, seed=SEED)
    results: list[Result] = []
    running: list[tuple[Result, BenchModel]] = []
    for config in configs:
        if config.models is not None and name not in config.models:
            continue
        result = Result(name, config.name)
        results.append(result)
        progress(f"{name}: preparing {config.name}")
        model = copy.deepcopy(base)
        try:
            result.note = config.prepare(model) or ""
            torch.manual_seed(SEED)
            _timed_step(model, batch, device)  # warm-up: lazy imports, allocator, caches
        except Exception as e:
            fail(result, note(e))
            continue
        running.append((result, model))
    reference: list[torch.Tensor] | None = None
    for result, model in running:
        progress(f"{name}: memory of {result.config}")
        result.peak_bytes, result.held_bytes, grads = _tracked_step(model, batch)
        if reference is None and result.config == NO_REMAT:
            reference = grads
        if reference is not None:
            check_grads(result, _max_diff(grads, reference), reference)
    for r in range(repeats):
        for result, model in running:
            progress(f"{name}: repeat {r + 1}/{repeats}, {result.config}")
            torch.manual_seed(SEED + r)
            steps = [_timed_step(model, batch, device) for _ in range(STEPS_PER_REPEAT)]
            result.step_seconds.append(min(steps))
    return results


def bench_tiny(
    device: torch.device,
    repeats: int,
    configs: Sequence[Config],
    progress: Callable[[str], None],
    calls: int = 100,
) -> list[Result]:
    """Per-call overhead: forward+backward of the tiny function per call, every configuration interleaved.

    A call takes microseconds, so a repeat is cheap and a burst of load on the machine is large against it:
    each of `repeats` repeats is split into `TINY_ROUNDS` interleaved rounds of `calls` calls, each timed alone,
    and the rows hold every round (their median is what the table shows).
    """
    x = tiny_input(device)
    seed_grad = torch.ones_like(x)
    results: list[Result] = []
    running: list[tuple[Result, Callable[[torch.Tensor], torch.Tensor]]] = []
    reference: torch.Tensor | None = None
    for config in configs:
        if config.wrap_tiny is None or (config.models is not None and "tiny" not in config.models):
            continue
        result = Result("tiny", config.name)
        results.append(result)
        progress(f"tiny: preparing {config.name}")
        try:
            fn = config.wrap_tiny(tiny)
            for _ in range(20):  # warm-up
                x.grad = None
                torch.autograd.backward(fn(x), seed_grad)
        except Exception as e:
            fail(result, note(e))
            continue
        assert x.grad is not None
        if reference is None and config.name == NO_REMAT:
            reference = x.grad.clone()
        if reference is not None:
            check_grads(result, float((x.grad - reference).abs().max()), [reference])
        running.append((result, fn))
    for r in range(repeats * TINY_ROUNDS):
        for result, fn in running:
            progress(f"tiny: round {r + 1}/{repeats * TINY_ROUNDS}, {result.config}")
            _sync({device})
            start = time.perf_counter()
            for _ in range(calls):
                torch.autograd.backward(fn(x), seed_grad)
            _sync({device})
            result.step_seconds.append((time.perf_counter() - start) / calls)
    by_name = {res.config: res.step for res in results}
    plain, theirs = by_name.get(NO_REMAT), by_name.get(TORCH)
    for res in results:
        ours = res.step
        if res.config in (NO_REMAT, TORCH) or None in (ours, plain, theirs):
            continue
        assert ours is not None and plain is not None and theirs is not None
        if theirs > plain:
            ratio = (ours - plain) / (theirs - plain)
            target = "target ≤ 0.33" if res.config == "@remat" else "the target is @remat's"
            res.note = f"overhead {ratio:.2f} of torch's ({target})"
    return results
