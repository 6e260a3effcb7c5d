"""`python -m benchmarks --model budget`: `remat.apply(model, budget=...)` against uniform configurations and
`torch.compile`'s `activation_memory_budget`.

First the sweep of benchmarks/budget_sweep.py over seven workloads (`--quick`: two of them, three fractions).

On the GPT-like stack, for each budget fraction f of no remat's measured activation peak: our plan's predicted
and measured peak, its predicted and measured step time, the fastest uniform configuration (every-N full remat,
save_matmuls on every N blocks, no remat) that fits the same budget, all measured in this run with the same
weights and batch, and the planning time in training steps. The convnet runs at a few budgets. Step times are
medians of interleaved repeats. Then, in a second table, `torch.compile` (inductor, each block compiled) with
`torch._functorch.config.activation_memory_budget = f`, each fraction in a fresh process: its peak (the rise of
the process's resident memory over one step) and its step time, both relative to compiled code without a budget
(see benchmarks/budget_compile.py). `--plot` draws peak against step time for all of them (`plot`).
"""

from __future__ import annotations

import copy
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
import torch.nn.functional as F

import remat
from remat._core.units import aligned
from remat._core.units import ratio as _ratio
from remat._demo import CONVNET_SIZES, GPT, GPT_SIZES, BenchModel, ConvNet
from tests.models import WORKLOADS

from .budget_compile import compile_column
from .budget_sweep import FRACTIONS as SWEEP_FRACTIONS
from .budget_sweep import LEGEND, QUICK, QUICK_FRACTIONS, format_sweep, short, sweep
from .table import PLOT_MISSING

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
            least = e.least_bytes
            row.note = "infeasible" if least is None else f"smallest feasible budget is {_mib(least)} MiB"
            continue
        row.plan_seconds = time.perf_counter() - start
        plan = remat.plan(model).budget
        assert plan is not None
        row.predicted_peak, row.predicted_time = plan.peak_bytes, plan.step_time
        row.choices = " ".join(short(plan.choices[c]) for c in plan.choice)
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
    theirs = compile_column(fractions, size, repeats, progress=progress) if compiled else {}
    return rows, theirs


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.0f}"


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
                "best uniform that fits", "ours/uniform", "plan (steps)", "choices")
        table = [head]
        for r in (r for r in mine if r.fraction is not None):
            fits = [u for u in uniform if u.peak is not None and r.budget is not None and u.peak <= r.budget
                    and u.step is not None]
            best = min(fits, key=lambda u: u.step or 0.0) if fits else None
            table.append((
                f"{r.fraction:.0%}", _mib(r.budget), _ratio(r.peak, r.budget), _ratio(r.predicted_peak, r.peak),
                _ms(r.step), _ratio(r.predicted_time, r.step), _ratio(r.step, none.step),
                f"{best.name} ({_ms(best.step)})" if best else "none fits", _ratio(r.step, best.step if best else None),
                _ratio(r.plan_seconds, none.step), r.choices or r.note,
            ))
        lines.append(f"{model}: remat.apply(model, budget=f * no remat's peak); plan (steps): planning seconds / "
                     "no remat's step")
        lines += aligned(table, right=True)
        lines.append("")
    lines.append(LEGEND)
    return "\n".join(lines)


def format_compile(rows: Sequence[Row], theirs: dict[float, dict[str, Any]]) -> str:
    """torch.compile's column beside ours on the GPT-like stack, each relative to its own run without a budget."""
    base = theirs.get(1.0, {})
    if "error" in base:
        return f"torch.compile column not available: {base['error']}"
    gpt = [r for r in rows if r.model == "gpt"]
    none = next((r for r in gpt if r.fraction is None), None)
    ours = {r.fraction: r for r in gpt if r.fraction is not None}
    table: list[tuple[str, ...]] = [("budget", "compile peak MiB", "peak/own 1.0", "step ms", "time/own 1.0",
                                     "remat peak/none", "remat time/none", "")]
    for fraction in sorted(theirs):
        other, mine = theirs[fraction], ours.get(fraction)
        mine_peak = _ratio(mine.peak, none.peak) if mine and none else "-"
        mine_time = _ratio(mine.step, none.step) if mine and none else "-"
        if "error" in other:
            table.append((f"{fraction:.0%}", "-", "-", "-", "-", mine_peak, mine_time, f"failed: {other['error']}"))
            continue
        table.append((
            f"{fraction:.0%}", _mib(other["peak"]), _ratio(other["peak"], base.get("peak")), _ms(other["step"]),
            _ratio(other["step"], base.get("step")), mine_peak, mine_time, "",
        ))
    seconds = [v["compile_seconds"] for v in theirs.values() if "compile_seconds" in v]
    head = ("gpt: torch.compile (inductor, each block compiled) with torch._functorch.config.activation_memory_budget"
            "=f, one process per f; peak = resident memory's rise over one step (MALLOC_MMAP_THRESHOLD_=131072); "
            "beside it remat.apply(budget=f) from the table above")
    tail = f"compiling took {min(seconds):.0f}-{max(seconds):.0f} s per fraction" if seconds else ""
    return "\n".join([head, *aligned(table, right=True), tail]).rstrip()


def plot(rows: Sequence[Row], theirs: dict[float, dict[str, Any]], path: str) -> None:
    """Write a PNG of peak against step time, one panel per model, each relative to its own run without a budget.

    Uniform configurations are squares, `remat.apply(budget=f)` a line through its budgets, torch.compile's
    `activation_memory_budget` (GPT-like stack only) a dashed line: the lower left is better.

    Raises:
        RuntimeError: matplotlib is not installed (the message says how to get it).
    """
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(PLOT_MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        done = [r for r in rows if r.model == model and r.step is not None and r.peak is not None]
        none = next(r for r in done if r.fraction is None)
        t0, p0 = float(none.step or 1.0), float(none.peak or 1)
        uniform = [(r.name, (r.step or 0.0) / t0, (r.peak or 0) / p0) for r in done if r.fraction is None]
        ours = [((r.step or 0.0) / t0, (r.peak or 0) / p0) for r in done if r.fraction is not None]
        ax.scatter([x for _, x, _ in uniform], [y for _, _, y in uniform], marker="s", color="gray",
                   label="uniform (no remat, every-N full remat, save_matmuls every N)")
        for label, x, y in uniform:
            ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        fractions = [r.fraction for r in done if r.fraction is not None]
        span = f"f = {min(fractions):.1f} ... {max(fractions):.1f}" if fractions else "no budget fitted"
        ax.plot([x for x, _ in ours], [y for _, y in ours], "o-", label=f"remat.apply(budget=f), {span}")
        base = theirs.get(1.0, {})
        points = [v for _, v in sorted(theirs.items()) if "peak" in v and "peak" in base]
        if model == "gpt" and points:
            ax.plot([v["step"] / base["step"] for v in points], [v["peak"] / base["peak"] for v in points], "^--",
                    label="torch.compile, activation_memory_budget=f")
        ax.set_title(f"{model}: activation peak against step time")
        ax.set_xlabel("step time / own step time without a budget")
        ax.set_ylabel("peak / own peak without a budget")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(size: str, repeats: int, plot_path: str | None, progress: Callable[[str], None], out: TextIO,
         compiled: bool = True, quick: bool = False) -> int:
    """Run and print the budget benchmark (`python -m benchmarks --model budget`): the seven workloads' sweep, then the
    GPT-like stack and convnet against uniform configurations and torch.compile (not with `quick`: a subset of
    the sweep only). 2 when `--plot` cannot be drawn; 1 when a plan went over its budget or was refused falsely."""
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        print(PLOT_MISSING, file=sys.stderr)
        return 2
    names, fractions = (QUICK, QUICK_FRACTIONS) if quick else (tuple(WORKLOADS), SWEEP_FRACTIONS)
    text, kept = format_sweep(sweep(names, fractions, 1 if quick else repeats, progress))
    print("remat.apply(model, budget=f * no remat's measured peak, sample=...): one real tracked step per plan; "
          "vs uniform: step time over the fastest uniform configuration whose measured peak fits", file=out)
    print(text, file=out, flush=True)
    if quick:
        return 0 if kept else 1
    rows, _ = run(size, repeats, compiled=False, progress=progress)
    print(format_table(rows, {}), file=out, flush=True)  # ours first: compiling takes a few minutes
    theirs: dict[float, dict[str, Any]] = {}
    if compiled:
        theirs = compile_column(FRACTIONS, size, repeats, progress=progress)
        print("\n" + format_compile(rows, theirs), file=out, flush=True)
    if plot_path:
        plot(rows, theirs, plot_path)
        print(f"\nwrote {plot_path}", file=out)
    return 0 if kept else 1
