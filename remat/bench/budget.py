"""`python -m remat --model budget`: `remat.apply(model, budget=...)` against uniform configurations and
`torch.compile`'s `activation_memory_budget` (spec §5.7).

On the GPT-like stack, for each budget fraction f of no remat's measured activation peak: our plan's predicted
and measured peak, its predicted and measured step time, the fastest uniform configuration (every-N full remat,
save_matmuls on every N blocks, no remat) that fits the same budget, all measured in this run with the same
weights and batch, and the planning time in training steps. Beside it, `torch.compile` (inductor) with
`torch._functorch.config.activation_memory_budget = f`, each fraction in a fresh process: its peak (the rise of
the process's resident memory over one step, with `MALLOC_MMAP_THRESHOLD_=131072` so that freed tensors go back
to the system, on CPU) and its step time, both relative to compiled code without a budget. The convnet runs at a
few budgets. Step times are medians of interleaved repeats.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
import torch.nn.functional as F

import remat

from .models import CONVNET_SIZES, GPT, GPT_SIZES, BenchModel, ConvNet

__all__ = ["FRACTIONS", "main", "run"]

FRACTIONS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
CONVNET_FRACTIONS = (0.6, 0.7, 0.8, 0.9)  # below ~0.58 no per-block choice fits: the stem and head dominate
SEED = 1234


@dataclass
class Row:
    """One measured configuration."""

    model: str
    name: str
    fraction: float | None = None
    budget: int | None = None
    peak: int | None = None
    predicted_peak: int | None = None
    predicted_time: float | None = None
    plan_seconds: float | None = None
    choices: str = ""
    times: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def step(self) -> float | None:
        return statistics.median(self.times) if self.times else None


def _loss_fn(model: BenchModel, batch: Sequence[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    target = batch[1]
    if isinstance(model, GPT):
        return lambda logits: F.cross_entropy(logits.flatten(0, 1), target.flatten())
    return lambda logits: F.cross_entropy(logits, target)


def _step(model: BenchModel, batch: Sequence[torch.Tensor]) -> float:
    for p in model.parameters():
        p.grad = None
    start = time.perf_counter()
    torch.autograd.backward(model.loss(*batch))
    return time.perf_counter() - start


def _peak(model: BenchModel, batch: Sequence[torch.Tensor]) -> int:
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients are outside the activation peak, as in the main table
    torch.manual_seed(SEED)
    with remat.track() as t:
        loss = model.loss(*batch)
        torch.autograd.backward(loss)
        del loss
    return t.peak_bytes


def _uniform(base: BenchModel) -> list[tuple[str, BenchModel]]:
    out: list[tuple[str, BenchModel]] = [("no remat", copy.deepcopy(base))]
    for every in (1, 2, 3, 4):
        out.append((f"full remat, every {every}", remat.apply(copy.deepcopy(base), every=every)))
    for every in (1, 2, 3, 4):
        policy = remat.policies.save_matmuls
        out.append((f"save_matmuls, every {every}", remat.apply(copy.deepcopy(base), every=every, policy=policy)))
    return out


def _bench(
    name: str, base: BenchModel, fractions: Sequence[float], repeats: int, progress: Callable[[str], None]
) -> list[Row]:
    base.train()
    batch = base.sample(torch.device("cpu"), seed=SEED)
    rows: list[Row] = []
    running: list[tuple[Row, BenchModel]] = []
    for label, model in _uniform(base):
        progress(f"{name}: {label}")
        row = Row(name, label)
        torch.manual_seed(SEED)
        _step(model, batch)  # warm-up
        row.peak = _peak(model, batch)
        rows.append(row)
        running.append((row, model))
    none = rows[0].peak
    assert none is not None
    for fraction in fractions:
        progress(f"{name}: planning for {fraction:.0%} of no remat's peak")
        row = Row(name, f"remat budget {fraction:.0%}", fraction=fraction, budget=int(fraction * none))
        rows.append(row)
        model = copy.deepcopy(base)
        start = time.perf_counter()
        try:
            remat.apply(model, budget=row.budget, sample=batch[0], loss=_loss_fn(model, batch))
        except remat.BudgetError as e:
            row.note = str(e).split(";")[1].strip().split(".")[0] if ";" in str(e) else "infeasible"
            continue
        row.plan_seconds = time.perf_counter() - start
        plan = remat.plan(model).budget
        assert plan is not None
        row.predicted_peak, row.predicted_time = plan.peak_bytes, plan.step_time
        row.choices = " ".join(_short(plan.choices[c]) for c in plan.choice)
        torch.manual_seed(SEED)
        _step(model, batch)
        row.peak = _peak(model, batch)
        running.append((row, model))
    for r in range(repeats):
        for row, model in running:
            progress(f"{name}: repeat {r + 1}/{repeats}, {row.name}")
            torch.manual_seed(SEED + r)
            row.times.append(_step(model, batch))
    return rows


def _short(label: str) -> str:
    return {"kept": "K", "save_matmuls": "M", "full": "F"}.get(label, "P")


_COMPILED = r"""
import json, os, statistics, sys, time
import torch
import torch._functorch.config
from remat.bench.models import GPT, GPT_SIZES
fraction, size, repeats = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
torch._functorch.config.activation_memory_budget = fraction
torch.manual_seed(1234)
model = GPT(GPT_SIZES[size]).train()
batch = model.sample(torch.device("cpu"), seed=1234)
step = torch.compile(lambda a, b: model.loss(a, b))
def rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
for p in model.parameters():
    p.grad = torch.zeros_like(p)
for _ in range(2):
    step(*batch).backward()
before = rss("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the high-water mark
step(*batch).backward()
peak = rss("VmHWM:") - before
times = []
for _ in range(repeats):
    start = time.perf_counter()
    step(*batch).backward()
    times.append(time.perf_counter() - start)
print(json.dumps({"peak": peak, "step": statistics.median(times)}))
"""


def _compiled(fraction: float, size: str, repeats: int) -> dict[str, Any]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILED, str(fraction), size, str(repeats)],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": tail[:100]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run(
    size: str = "small",
    repeats: int = 3,
    fractions: Sequence[float] = FRACTIONS,
    compiled: bool = True,
    progress: Callable[[str], None] = lambda message: None,
) -> tuple[list[Row], dict[float, dict[str, Any]]]:
    """Run the budget benchmark; return our rows and torch.compile's figures per fraction (1.0 is its baseline)."""
    torch.manual_seed(SEED)
    rows = _bench("gpt", GPT(GPT_SIZES[size]), fractions, repeats, progress)
    torch.manual_seed(SEED)
    rows += _bench("convnet", ConvNet(CONVNET_SIZES[size]), CONVNET_FRACTIONS, repeats, progress)
    theirs: dict[float, dict[str, Any]] = {}
    if compiled:
        for fraction in sorted({*fractions, 1.0}, reverse=True):
            progress(f"torch.compile, activation_memory_budget={fraction}")
            theirs[fraction] = _compiled(fraction, size, repeats)
    return rows, theirs


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def format_table(rows: Sequence[Row], theirs: dict[float, dict[str, Any]]) -> str:
    """The budget benchmark as aligned text."""
    lines: list[str] = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        uniform = [r for r in mine if r.fraction is None]
        none = uniform[0]
        lines.append(f"{model}: uniform configurations (peak MiB, step ms)")
        for r in uniform:
            lines.append(f"  {r.name:<24} peak {_mib(r.peak):>8}  ({_ratio(r.peak, none.peak)} of none)  step "
                         f"{_ms(r.step):>6}  ({_ratio(r.step, none.step)} of none)")
        head = ("budget", "MiB", "peak/budget", "pred/meas peak", "step ms", "pred/meas time", "time/none",
                "best uniform that fits", "ours/uniform", "plan (steps)", "compile peak", "compile time", "choices")
        table = [head]
        for r in (r for r in mine if r.fraction is not None):
            fits = [u for u in uniform if u.peak is not None and r.budget is not None and u.peak <= r.budget
                    and u.step is not None]
            best = min(fits, key=lambda u: u.step or 0.0) if fits else None
            other = theirs.get(r.fraction or 0.0, {}) if model == "gpt" else {}
            base = theirs.get(1.0, {})
            if "error" in other:
                peak_c, time_c = "failed", other["error"][:40]
            elif other and base and "peak" in base:
                peak_c, time_c = _ratio(other["peak"], base["peak"]), _ratio(other["step"], base["step"])
            else:
                peak_c = time_c = "-"
            table.append((
                f"{r.fraction:.0%}", _mib(r.budget), _ratio(r.peak, r.budget), _ratio(r.predicted_peak, r.peak),
                _ms(r.step), _ratio(r.predicted_time, r.step), _ratio(r.step, none.step),
                f"{best.name} ({_ms(best.step)})" if best else "none fits", _ratio(r.step, best.step if best else None),
                _ratio(r.plan_seconds, none.step), peak_c, time_c, r.choices or r.note,
            ))
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        lines.append(f"{model}: remat.apply(model, budget=f * no remat's peak); compile columns: torch.compile "
                     "with activation_memory_budget=f, peak (RSS rise) and time relative to its budget 1.0")
        for row in table:
            lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(row[:-1], widths, strict=False)) + "  " + row[-1])
        lines.append("")
    lines.append("choices per block: K kept, M save_matmuls, F full remat")
    return "\n".join(lines)


def plot(rows: Sequence[Row], theirs: dict[float, dict[str, Any]], path: str) -> None:
    """Peak against step time, both relative to each side's own no-budget run (needs matplotlib)."""
    import importlib

    matplotlib: Any = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")
    fig, ax = plt.subplots(figsize=(7, 5))
    gpt = [r for r in rows if r.model == "gpt" and r.step is not None and r.peak is not None]
    t0, p0 = float(gpt[0].step or 1.0), float(gpt[0].peak or 1)
    uni = [(r.name, (r.step or 0.0) / t0, (r.peak or 0) / p0) for r in gpt if r.fraction is None]
    ours = [((r.step or 0.0) / t0, (r.peak or 0) / p0) for r in gpt if r.fraction is not None]
    ax.scatter([x for _, x, _ in uni], [y for _, _, y in uni], label="uniform", marker="s")
    for label, x, y in uni:
        ax.annotate(label, (x, y), fontsize=7)
    ax.plot([x for x, _ in ours], [y for _, y in ours], "o-", label="remat budget")
    base = theirs.get(1.0, {})
    pts = sorted((f, v) for f, v in theirs.items() if "peak" in v and "peak" in base)
    if pts:
        ax.plot([v["step"] / base["step"] for _, v in pts], [v["peak"] / base["peak"] for _, v in pts], "^--",
                label="torch.compile activation_memory_budget")
    ax.set_xlabel("step time / own no-budget step time")
    ax.set_ylabel("peak / own no-budget peak")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(size: str, repeats: int, plot_path: str | None, progress: Callable[[str], None], out: TextIO,
         compiled: bool = True) -> int:
    """Run and print the budget benchmark (`python -m remat --model budget`)."""
    rows, _ = run(size, repeats, compiled=False, progress=progress)
    print(format_table(rows, {}), file=out, flush=True)  # ours first: compiling takes minutes per fraction
    if not compiled:
        return 0
    rows, theirs = rows, {}
    for fraction in sorted({*FRACTIONS, 1.0}, reverse=True):
        progress(f"torch.compile, activation_memory_budget={fraction}")
        theirs[fraction] = _compiled(fraction, size, repeats)
    print("\nwith torch.compile (inductor):", file=out)
    print(format_table([r for r in rows if r.model == "gpt"], theirs), file=out)
    if plot_path:
        plot(rows, theirs, plot_path)
    return 0
