"""Tiny functions: replay's overhead per recorded op, start-up cost in a fresh process."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import remat
from remat._engine.modes import Mode
from remat._measure.measurement import format_seconds

from .runner import Result, fail, note, sync, tiny_input

__all__ = ["EMPTY_MODE", "REGION", "REPLAY_OPS", "bench_replay", "bench_startup"]

REPLAY_OPS = 64


def _many_ops(x: torch.Tensor) -> torch.Tensor:
    for _ in range(REPLAY_OPS // 2):
        x = (x * 1.0001).sin()
    return x


class _Empty(Mode):
    """An empty dispatch mode: the floor for recording ops in Python.

    remat's own `Mode` base, so it skips torch's dynamo guard as remat's recorder does (NOTE [ Modes without the
    dynamo guard ]): the floor is the cheapest Python mode, not one slowed by the guard.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


EMPTY_MODE = "empty TorchDispatchMode forward, per op"
REGION = "remat.region forward, per op"


def _best_of_three(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int) -> float:
    fn(x)  # warm-up
    sync({x.device})
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        sync({x.device})
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def bench_replay(device: torch.device, repeats: int, progress: Callable[[str], None], calls: int = 30) -> list[Result]:
    """Forward-only overhead per op of `remat.region` and of an empty dispatch mode.

    Per grad setting, three functions run interleaved in every repeat: the plain ops, the ops under an empty
    `TorchDispatchMode`, and the ops in a region; a row holds (its time - plain time) / ops per repeat. Without
    grad the region's cost is the recording alone; with grad it adds the saved-tensor hooks of the ops that
    save tensors (`sin` saves its input: half of the ops here).
    """

    def empty(x: torch.Tensor) -> torch.Tensor:
        with _Empty():
            return _many_ops(x)

    def region(x: torch.Tensor) -> torch.Tensor:
        with remat.region():
            return _many_ops(x)

    rows: list[Result] = []
    for grad in (False, True):
        suffix = ", with grad" if grad else ""
        floor = Result("tiny", EMPTY_MODE + suffix, compare=False)
        ours = Result("tiny", REGION + suffix, compare=False)
        x = tiny_input(device).requires_grad_(grad)
        plain_times: list[float] = []
        for r in range(repeats):
            progress(f"tiny: replay overhead{suffix}, repeat {r + 1}/{repeats}")
            plain, under_mode, in_region = (_best_of_three(fn, x, calls) for fn in (_many_ops, empty, region))
            plain_times.append(plain)
            floor.step_seconds.append((under_mode - plain) / REPLAY_OPS)
            ours.step_seconds.append((in_region - plain) / REPLAY_OPS)
        op = format_seconds(statistics.median(plain_times) / REPLAY_OPS)
        floor.note = f"the floor for recording in Python; an op itself takes {op}"
        ours.note = "overhead per recorded op (target ≤ 1.5x the empty mode's, same run)"
        rows += [floor, ours]
    return rows


_STARTUP = """
import time, torch
t0 = time.perf_counter()
import remat
t1 = time.perf_counter()
x = torch.randn(16, requires_grad=True)
f = remat.remat(lambda t: (t * 2).sin())
t2 = time.perf_counter()
f(x).sum().backward()
t3 = time.perf_counter()
print(t1 - t0, t3 - t2)
"""


def bench_startup(progress: Callable[[str], None]) -> list[Result]:
    """Cost of ``import remat`` after ``import torch``, and of the first @remat call, in a fresh process."""
    import os
    import subprocess
    from pathlib import Path

    progress("startup: import remat and first call in a fresh process")
    imported = Result("startup", "import remat (after torch)", compare=False)
    first = Result("startup", "first @remat call, forward+backward", compare=False)
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    # Measured as installed packages run: from cached bytecode. The first run writes it (an environment with
    # PYTHONDONTWRITEBYTECODE would otherwise compile every module on every import); the median of three after.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    try:
        for run in range(4):
            done = subprocess.run(
                [sys.executable, "-c", _STARTUP], capture_output=True, text=True, env=env, timeout=300, check=True
            )
            import_s, first_s = (float(v) for v in done.stdout.split()[-2:])
            if run:
                imported.step_seconds.append(import_s)
                first.step_seconds.append(first_s)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        fail(imported, note(e))
        fail(first, note(e))
        return [imported, first]
    imported.note = "target ≤ 50 ms (cached bytecode)"
    first.note = "target: no one-off second of set-up"
    return [imported, first]
