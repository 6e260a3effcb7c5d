"""Spec §5.2 and §5.6 on tiny functions: replay's overhead per recorded op, start-up cost in a fresh process."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable

import torch

import remat

from .._measure.measure import format_seconds
from .models import tiny_input
from .runner import Result, note, sync

__all__ = ["REPLAY_OPS", "bench_replay", "bench_startup"]

REPLAY_OPS = 64


def _many_ops(x: torch.Tensor) -> torch.Tensor:
    for _ in range(REPLAY_OPS // 2):
        x = (x * 1.0001).sin()
    return x


def bench_replay(device: torch.device, repeats: int, progress: Callable[[str], None], calls: int = 30) -> list[Result]:
    """Forward-only overhead of `remat.region` per recorded op (spec §5.2), against the plain function.

    Two rows: ops on a tensor that needs no grad (the recording alone), and on one that does (recording plus
    the saved-tensor hooks of the ops that save tensors: `sin` saves its input, half of the ops here).
    """
    rows = [
        (Result("tiny", "remat.region forward, per op", compare=False), False),
        (Result("tiny", "remat.region forward, per op, with grad", compare=False), True),
    ]
    def region(x: torch.Tensor) -> torch.Tensor:
        with remat.region():
            return _many_ops(x)

    for result, grad in rows:
        x = tiny_input(device).requires_grad_(grad)
        plain_times: list[float] = []
        for r in range(repeats):
            progress(f"tiny: replay overhead, repeat {r + 1}/{repeats}")
            pair = []
            for fn in (_many_ops, region):
                fn(x)  # warm-up
                sync({device})
                best = math.inf
                for _ in range(3):
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn(x)
                    sync({device})
                    best = min(best, (time.perf_counter() - start) / calls)
                pair.append(best)
            plain_times.append(pair[0])
            result.step_seconds.append((pair[1] - pair[0]) / REPLAY_OPS)
        plain = format_seconds(statistics.median(plain_times) / REPLAY_OPS)
        result.note = f"overhead per recorded op (§5.2 target ≤ 5 µs); an op itself takes {plain}"
    return [result for result, _ in rows]


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
    """Cost of ``import remat`` after ``import torch``, and of the first @remat call (spec §5.6), in a fresh process."""
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
        imported.note = first.note = f"failed: {note(e)}"
        return [imported, first]
    imported.note = "§5.6 target ≤ 50 ms (cached bytecode)"
    first.note = "§5.6: no one-off second of set-up"
    return [imported, first]
