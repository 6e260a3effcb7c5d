"""The torch.compile column of `python -m benchmarks --model budget`: inductor under `activation_memory_budget`.

For each budget fraction f, a fresh Python process builds the same GPT-like stack (same seed, same batch), sets
`torch._functorch.config.activation_memory_budget = f`, compiles every block with inductor (regional
compilation: `block.compile()`, one graph per block, reused by the identical blocks; PyTorch recommends it to
cut compile time, and it brings a fraction's run from about 4 minutes for the whole model to about 30 s on 2
CPU cores), runs two warm-up steps, then one step for the peak and `repeats` steps for the time. The budget
thus applies to each block's forward/backward graph: the fraction of each block's activations that inductor's
partitioner may keep. The peak is the rise of the process's resident memory over one step (its high-water
mark reset first), with `MALLOC_MMAP_THRESHOLD_=131072` so that freed tensors go back to the system; both
figures are reported relative to the same run at f = 1.0 (no budget). The child sets `torch.set_num_threads`
to the parent's thread count (`--threads`). Any failure (no C++ compiler, an inductor error, a timeout) comes
back as a one-line reason, never a traceback; when the baseline fails, the other fractions are not tried.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["SCRIPT", "compile_column", "run_fraction"]

TIMEOUT = 600  # seconds per fraction

SCRIPT = r"""
import json, statistics, sys, time
try:
    import torch
    import torch._functorch.config as functorch_config
    from remat._demo import GPT, GPT_SIZES
    fraction, size, repeats, threads = float(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(threads)
    if not hasattr(functorch_config, "activation_memory_budget"):
        raise RuntimeError(f"torch {torch.__version__} has no activation_memory_budget")
    functorch_config.activation_memory_budget = fraction
    torch.manual_seed(1234)
    model = GPT(GPT_SIZES[size]).train()
    batch = model.sample(torch.device("cpu"), seed=1234)
    start = time.perf_counter()
    for block in model.blocks:
        block.compile()

    def rss(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no " + field + " in /proc/self/status")

    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients are outside the peak, as in the eager rows
    for _ in range(2):
        model.loss(*batch).backward()
    compile_seconds = time.perf_counter() - start
    before = rss("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark
    model.loss(*batch).backward()
    peak = rss("VmHWM:") - before
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.loss(*batch).backward()
        times.append(time.perf_counter() - start)
    print(json.dumps({"peak": peak, "step": statistics.median(times), "compile_seconds": compile_seconds}))
except Exception as e:
    reason = (str(e).strip().splitlines() or [""])[0][:160]
    print(json.dumps({"error": f"{type(e).__name__}: {reason}"}))
"""


def run_fraction(fraction: float, size: str, repeats: int, threads: int, timeout: float = TIMEOUT) -> dict[str, Any]:
    """One fraction in a fresh process: `{"peak", "step", "compile_seconds"}`, or `{"error": reason}`.

    >>> run_fraction(0.5, "no such size", 1, 1)["error"]
    "KeyError: 'no such size'"
    """
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(fraction), size, str(repeats), str(threads)],
            env=env, capture_output=True, text=True, timeout=timeout, check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    except OSError as e:
        return {"error": f"could not start {sys.executable}: {e}"}
    lines = done.stdout.strip().splitlines()
    if lines:
        try:
            result: dict[str, Any] = json.loads(lines[-1])
            return result
        except json.JSONDecodeError:
            pass
    tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}, no output"])[-1]
    return {"error": tail[:160]}


def compile_column(
    fractions: Sequence[float],
    size: str,
    repeats: int,
    threads: int | None = None,
    progress: Callable[[str], None] = lambda message: None,
    runner: Callable[[float, str, int, int], dict[str, Any]] = run_fraction,
) -> dict[float, dict[str, Any]]:
    """torch.compile's figures per fraction, the baseline 1.0 first; the rest are skipped if it fails.

    >>> compile_column([0.5], "small", 1, 1, runner=lambda f, s, r, t: {"error": "no compiler"})
    {1.0: {'error': 'no compiler'}}
    """
    threads = threads or torch.get_num_threads()
    out: dict[float, dict[str, Any]] = {}
    for fraction in sorted({*fractions, 1.0}, reverse=True):
        progress(f"torch.compile, activation_memory_budget={fraction}")
        out[fraction] = runner(fraction, size, repeats, threads)
        if fraction == 1.0 and "error" in out[fraction]:
            break
    return out
