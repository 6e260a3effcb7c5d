"""remat inside `torch.compile`: what each way of marking blocks holds, beside torch's own (inductor, CPU).

    python -m benchmarks.compile_sites [--batch 1024] [--blocks 6] [--repeats 5] [--trials 1]
        [--fractions 0.3,0.5,0.8]

A stack of MLP blocks (Linear(512->2048), GELU, Linear(2048->512), GELU) is marked one way per row, each block is
compiled with inductor (`block.compile()`, one graph reused by the identical blocks; `--whole`: the stack as
one graph, which blocks with different choices need), and after two warm-up
steps one step is measured: the bytes held after the compiled forward (the rise of the process's resident memory
from before forward to after it) and the step's peak (the rise of its high-water mark), with
`MALLOC_MMAP_THRESHOLD_=131072` so that freed tensors go back to the system; then the fastest of `--repeats`
steps (the least disturbed by a shared machine: the same plan's median moved by 10% between processes). Every
row runs in a fresh Python process; with `--trials N` in N, in N passes over all the rows, keeping its fastest
step (the same plan's fastest step still moved by up to 15% between processes). Rows: no checkpointing; torch's
checkpoint per block and torch's selective checkpoint with a matmul policy; each remat site kind;
`remat.apply(model, budget=f, sample=...)` (planned on eager costs, and with `compile=True`) and
`torch._functorch.config.activation_memory_budget = f` at the same fractions. Each row's gradients are compared
with eager code without remat (float32, `allclose` at 1e-4); a row that differs says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["KINDS", "SCRIPT", "main", "run_row"]

KINDS = (
    "none", "torch checkpoint", "torch SAC matmuls", "@remat function", "remat.checkpoint", "@remat class",
    "remat(block)", "remat.apply", "remat(block)+save_matmuls",
)

SCRIPT = r"""
import functools, json, sys, time
try:
    import torch
    import torch.nn.functional as F
    from torch import nn
    import torch._functorch.config as functorch_config
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
    import remat

    kind, fraction, batch, blocks, repeats = sys.argv[1], float(sys.argv[2]), *map(int, sys.argv[3:6])
    torch.set_num_threads(int(sys.argv[6]))
    MM = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    SAC = functools.partial(create_selective_checkpoint_contexts, lambda ctx, op, *a, **k:
                            CheckpointPolicy.MUST_SAVE if op in MM else CheckpointPolicy.PREFER_RECOMPUTE)

    @remat
    def inner_remat(block, x):
        return block.inner(x)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(512, 2048), nn.Linear(2048, 512)
        def inner(self, x):
            return F.gelu(self.fc2(F.gelu(self.fc1(x))))
        def forward(self, x):
            if kind == "torch checkpoint":
                return checkpoint(self.inner, x, use_reentrant=False)
            if kind == "torch SAC matmuls":
                return checkpoint(self.inner, x, use_reentrant=False, context_fn=SAC)
            if kind == "@remat function":
                return inner_remat(self, x)
            if kind == "remat.checkpoint":
                return remat.checkpoint(self.inner, x, use_reentrant=False)
            return self.inner(x)

    @remat
    class Marked(Block):
        pass

    torch.manual_seed(0)
    stack = nn.Sequential(*[(Marked if kind == "@remat class" else Block)() for _ in range(blocks)])
    x = torch.randn(batch, 512, generator=torch.Generator().manual_seed(1))
    eager = torch.autograd.grad(stack(x).sum(), list(stack.parameters()))
    if kind == "remat(block)":
        for block in stack: remat(block)
    elif kind == "remat(block)+save_matmuls":
        for block in stack: remat(block, policy=remat.policies.save_matmuls)
    elif kind == "remat.apply":
        remat.apply(stack, Block)
    elif kind in ("remat budget", "remat budget, compile=True"):
        remat.apply(stack, Block, budget=fraction, sample=x, compile=kind.endswith("True"))
    elif kind == "compile budget":
        functorch_config.activation_memory_budget = fraction
    params = list(stack.parameters())
    if sys.argv[7] == "whole":
        stack = torch.compile(stack)
    else:
        for block in stack:
            block.compile()  # one graph per block, reused by the identical blocks

    def rss(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024

    for p in params:
        p.grad = torch.zeros_like(p)
    start = time.perf_counter()
    for _ in range(2):
        stack(x).sum().backward()
    compile_seconds = time.perf_counter() - start
    for p in params:
        p.grad.zero_()
    before = rss("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    loss = stack(x).sum()
    held = rss("VmRSS:") - before
    loss.backward()
    peak = rss("VmHWM:") - before
    same = all(torch.allclose(p.grad, g, rtol=1e-4, atol=1e-5) for p, g in zip(params, eager))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        stack(x).sum().backward()
        times.append(time.perf_counter() - t)
    print(json.dumps({"held": held, "peak": peak, "step": min(times), "grads": same,
                      "compile_seconds": compile_seconds}))
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"}))
"""


def run_row(kind: str, fraction: float, batch: int, blocks: int, repeats: int, threads: int,
            whole: bool = False, timeout: float = 600) -> dict[str, Any]:
    """One row in a fresh process: `{"held", "peak", "step", "grads", "compile_seconds"}` or `{"error"}`."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    argv = [sys.executable, "-c", SCRIPT, kind, str(fraction), str(batch), str(blocks), str(repeats), str(threads),
            "whole" if whole else "blocks"]
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    try:
        result: dict[str, Any] = json.loads(lines[-1])
        return result
    except (IndexError, json.JSONDecodeError):
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"error": tail[:160]}


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Print the rows; exit status 1 when a row's gradients differ from eager code's or it failed (a budget's
    `BudgetError` is an answer, not a failure)."""
    out = out or sys.stdout
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_sites", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trials", type=int, default=1,
                        help="fresh processes per row, run in passes over all rows; a row keeps its fastest step")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fractions", default="0.3,0.5,0.8")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated rows of the site table")
    parser.add_argument("--whole", action="store_true",
                        help="compile the whole stack as one graph instead of each block (blocks that differ in "
                        "their remat choice need it: dynamo does not guard on module hooks)")
    args = parser.parse_args(argv)
    kinds = [kind for kind in args.kinds.split(",") if kind]
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(KINDS)}")
    planned = [(kind, kind, 1.0) for kind in kinds] + [
        (f"{kind} {fraction:g}", kind, fraction)
        for fraction in (float(f) for f in filter(None, args.fractions.split(",")))
        for kind in ("remat budget", "remat budget, compile=True", "compile budget")
    ]
    trials: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in planned}
    for trial in range(args.trials):  # every row once per pass, so that a slow spell falls on all of them
        for label, kind, fraction in planned:
            row = run_row(kind, fraction, args.batch, args.blocks, args.repeats, args.threads, args.whole)
            trials[label].append(row)
            if trial == args.trials - 1:
                print(_line(label, _merged(trials[label]), _merged(trials.get("none", [{}]))), file=out, flush=True)
    rows = [(label, _merged(found)) for label, found in trials.items()]
    for line in _against_compile(rows):
        print(line, file=out)
    failed = [label for label, row in rows
              if not row.get("grads", True) or not row.get("error", "BudgetError").startswith("BudgetError")]
    if failed:
        print(f"{len(failed)} row(s) failed: {', '.join(failed)}", file=out)
    return 1 if failed else 0


def _against_compile(rows: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """Each of compile's own budget rows beside the fastest remat budget row whose peak is no higher: at equal or
    lower peak, is remat's step faster? (Rows compare across fractions: compile's budget may land over its own.)"""
    ours = [(label, row) for label, row in rows if label.startswith("remat budget") and "error" not in row]
    lines: list[str] = []
    behind = compared = 0
    for label, theirs in rows:
        if not label.startswith("compile budget") or "error" in theirs:
            continue
        fits = [(lbl, row) for lbl, row in ours if row["peak"] <= theirs["peak"]]
        if not fits:
            lines.append(f"{label}: peak {theirs['peak'] / 2**20:.1f} MiB, no remat budget row peaks as low")
            continue
        best_label, best = min(fits, key=lambda item: float(item[1]["step"]))
        ratio = best["step"] / theirs["step"]
        behind += ratio > 1.0
        compared += 1
        lines.append(f"{label}: peak {theirs['peak'] / 2**20:.1f} MiB, step {theirs['step'] * 1e3:.0f} ms; fastest "
                     f"remat row at no more peak: {best_label}, {best['peak'] / 2**20:.1f} MiB, "
                     f"{best['step'] * 1e3:.0f} ms ({ratio:.2f} of its step)")
    if lines:
        lines.insert(0, "at equal or lower peak (remat's fastest budget row against each of compile's own):")
        lines.append(f"remat slower at {behind} of {compared}")
    return lines


def _merged(found: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row from its trials: the first failure, else the first trial's bytes with the fastest step."""
    failed = [row for row in found if "error" in row]
    if failed or not found:
        return failed[0] if failed else {}
    return {**found[0], "step": min(row["step"] for row in found), "grads": all(row["grads"] for row in found)}


def _line(label: str, row: dict[str, Any], base: dict[str, Any]) -> str:
    if "error" in row:
        return f"{label:<34} {row['error']}"
    ratio = f"{row['peak'] / base['peak']:.2f}" if base.get("peak") else "-"  # against the "none" row, if run
    return (f"{label:<34} held {row['held'] / 2**20:7.1f} MiB  peak {row['peak'] / 2**20:7.1f} MiB ({ratio} of none)"
            f"  step {row['step'] * 1e3:6.0f} ms  grads {'equal eager' if row['grads'] else 'DIFFER'}")


if __name__ == "__main__":
    raise SystemExit(main())
