"""The benchmark's output: one aligned table, and a plot of memory against step time."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from remat._core.units import format_bytes, ratio
from remat._measure.measurement import format_seconds

from .configs import NO_REMAT, TORCH
from .runner import STEPS_PER_REPEAT, Result

__all__ = ["PLOT_MISSING", "format_table", "plot"]



def _ratio(a: float | None, b: float | None) -> str:
    return ratio(a, b, "x")


def _spread(seconds: Sequence[float]) -> str:
    """Half the range of the repeats, relative to their median: how much the machine moved."""
    if len(seconds) < 2:
        return "-"
    middle = sorted(seconds)[len(seconds) // 2]
    return f"±{(max(seconds) - min(seconds)) / 2 / middle:.0%}" if middle else "-"


def format_table(meta: dict[str, Any], rows: Sequence[Result]) -> str:
    """Render the benchmark as one aligned table with its header."""
    plural = "" if meta["threads"] == 1 else "s"
    repeats_plural = "" if meta["repeats"] == 1 else "s"
    lines = [
        f"remat benchmark · {meta['date']} · {meta['device']}, {meta['threads']} thread{plural} · "
        f"torch {meta['torch']} · size {meta['size']} · median of {meta['repeats']} repeat{repeats_plural}",
        *(f"  {name}: {text}" for name, text in meta["models"].items()),
        "  peak: highest live tensor bytes a training step adds beyond parameters and gradients;",
        "  held: bytes kept for backward at the end of forward (both counted by remat.track)",
        f"  step: median over interleaved repeats (each the fastest of {STEPS_PER_REPEAT} consecutive steps); spread: "
        "half their range, relative to the median",
        "",
    ]
    head = (
        "model",
        "configuration",
        "peak",
        "held",
        "step",
        "spread",
        "peak/none",
        "peak/torch",
        "time/none",
        "time/torch",
        "max|Δgrad|",
        "note",
    )
    table: list[tuple[str, ...]] = [head]
    by_key = {(r.model, r.config): r for r in rows}
    for r in rows:
        none, theirs = by_key.get((r.model, NO_REMAT)), by_key.get((r.model, TORCH))
        if not r.compare:
            none = theirs = None
        table.append(
            (
                r.model,
                r.config,
                "-" if r.peak_bytes is None else format_bytes(r.peak_bytes),
                "-" if r.held_bytes is None else format_bytes(r.held_bytes),
                format_seconds(r.step),
                _spread(r.step_seconds),
                _ratio(r.peak_bytes, none.peak_bytes if none else None),
                _ratio(r.peak_bytes, theirs.peak_bytes if theirs else None),
                _ratio(r.step, none.step if none else None),
                _ratio(r.step, theirs.step if theirs else None),
                "-" if r.grad_diff is None else f"{r.grad_diff:.1e}",
                r.note,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        cells = [c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row[:-1], widths, strict=False))]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
        if i == 0:
            lines.append("-" * len(lines[-1]))
    noisy = [r for r in rows if r.compare and len(r.step_seconds) > 1 and max(r.step_seconds) > 2 * min(r.step_seconds)]
    if noisy:
        worst = max(noisy, key=lambda r: max(r.step_seconds) / min(r.step_seconds))
        rows_text = f"{len(noisy)} row{'s' if len(noisy) > 1 else ''}"
        lines += [
            "",
            f"warning: the step times of {rows_text} varied more than 2x between repeats (worst: "
            f"{worst.model} {worst.config}, {format_seconds(min(worst.step_seconds))} to "
            f"{format_seconds(max(worst.step_seconds))}).",
            "  The machine was busy: time ratios may mislead. Try --threads 1 (no stalls of OpenMP threads "
            "waiting for each other) or more --repeats.",
        ]
    return "\n".join(lines)


def plot(meta: dict[str, Any], rows: Sequence[Result], path: str) -> None:
    """Save a PNG of peak memory against step time, one panel per model (needs matplotlib)."""
    matplotlib: Any = importlib.import_module("matplotlib")  # optional, untyped here
    matplotlib.use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")

    models = [m for m in meta["models"] if m != "tiny"]
    fig, axes = plt.subplots(1, max(len(models), 1), figsize=(6 * max(len(models), 1), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=False):
        for r in rows:
            if r.model != model or r.step is None or r.peak_bytes is None:
                continue
            ax.scatter(r.step * 1e3, r.peak_bytes / 2**20)
            ax.annotate(r.config, (r.step * 1e3, r.peak_bytes / 2**20), fontsize=8)
        ax.set_title(f"{model}: {meta['models'][model]}", fontsize=8)
        ax.set_xlabel("step time (ms)")
        ax.set_ylabel("peak live tensor memory (MiB)")
    fig.suptitle(f"remat benchmark, {meta['device']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PLOT_MISSING = (
    "remat: --plot needs matplotlib, which is not installed; install it with "
    "`pip install matplotlib` (or `pip install 'remat[plot]'`), or leave out --plot."
)
