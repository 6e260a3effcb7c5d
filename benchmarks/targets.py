"""The benchmark's performance targets checked against one run's rows: each with its measurement, its target and ✓ or ✗.

NOTE [ Ratios per repeat ]
Repeats interleave the configurations (``a b c a b c ...``), so the i-th repeat of every row ran at about the
same moment and under the same load. A ratio of two rows is therefore taken per repeat index, and a target
reports the median of those ratios with their spread (lowest to highest): a reader sees both whether the target
holds and how much the machine moved during the run. The verdict is on the median.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .chain import CHAIN
from .configs import NO_REMAT, TORCH
from .offload import SAVE_ON_CPU
from .runner import Result
from .tiny import EMPTY_MODE, REGION

__all__ = ["Check", "check_targets", "format_checks"]


@dataclass(frozen=True)
class Check:
    """One performance target: what was measured (median and spread), the bound, and whether it holds."""

    section: str
    what: str
    median: float
    low: float
    high: float
    target: str
    ok: bool

    def to_dict(self) -> dict[str, object]:
        return {"section": self.section, "what": self.what, "median": self.median, "low": self.low,
                "high": self.high, "target": self.target, "ok": self.ok}  # fmt: skip


def _per_repeat(fn: Callable[..., float], *rows: Result) -> list[float] | None:
    """`fn` of the rows' step times, per repeat index (NOTE [ Ratios per repeat ])."""
    if any(not row.step_seconds for row in rows):
        return None
    count = min(len(row.step_seconds) for row in rows)
    values = []
    for i in range(count):
        try:
            values.append(fn(*(row.step_seconds[i] for row in rows)))
        except ZeroDivisionError:
            continue
    return values or None


class _Checks:
    def __init__(self, rows: Sequence[Result]) -> None:
        self.by_key = {(row.model, row.config): row for row in rows}
        self.found: list[Check] = []

    def row(self, model: str, config: str) -> Result | None:
        return self.by_key.get((model, config))

    def add(self, section: str, what: str, values: Sequence[float] | None, bound: float, target: str) -> None:
        if not values:
            return
        median = statistics.median(values)
        self.found.append(Check(section, what, median, min(values), max(values), target, median <= bound))

    def add_value(self, section: str, what: str, value: float | None, bound: float, target: str) -> None:
        if value is not None:
            self.add(section, what, [value], bound, target)


def _overhead(ours: float, plain: float, theirs: float) -> float:
    return (ours - plain) / (theirs - plain)


def check_targets(rows: Sequence[Result], summary: dict[str, object] | None = None) -> list[Check]:
    """The targets this run's rows can check (rows that did not run are left out)."""
    c = _Checks(rows)
    plain, theirs, ours = c.row("tiny", NO_REMAT), c.row("tiny", TORCH), c.row("tiny", "@remat")
    if plain and theirs and ours:
        c.add("5.1", "@remat per-call overhead / torch.utils.checkpoint's", _per_repeat(_overhead, ours, plain, theirs),
              1 / 3, "≤ 0.33")  # fmt: skip
    for suffix in ("", ", with grad"):
        floor, region = c.row("tiny", EMPTY_MODE + suffix), c.row("tiny", REGION + suffix)
        if floor and region:
            c.add("5.2", f"region per-op overhead / empty mode's{suffix}",
                  _per_repeat(lambda a, b: a / b, region, floor), 1.5, "≤ 1.5x")  # fmt: skip
    for model in ("gpt", "convnet"):
        none, torch_row = c.row(model, NO_REMAT), c.row(model, TORCH)
        decorator, region = c.row(model, "@remat"), c.row(model, "remat.region")
        if decorator and region and model == "gpt":
            c.add("5.2", f"{model}: region step / @remat step", _per_repeat(lambda a, b: a / b, region, decorator),
                  1.05, "≤ 1.05x")  # fmt: skip
        if decorator and torch_row and none and decorator.peak_bytes and torch_row.peak_bytes and none.peak_bytes:
            c.add_value("5.3", f"{model}: @remat peak / torch's", decorator.peak_bytes / torch_row.peak_bytes,
                        1.02, "≤ 1.02x")  # fmt: skip
            if model == "gpt":  # the step-time target is the GPT stack's: a convnet's block inputs are much of its peak
                c.add_value("5.3", f"{model}: @remat peak / no remat's", decorator.peak_bytes / none.peak_bytes,
                            1 / 3, "≤ 0.33x")  # fmt: skip
            c.add("5.3", f"{model}: @remat step / torch's", _per_repeat(lambda a, b: a / b, decorator, torch_row),
                  1.0, "≤ 1.00x")  # fmt: skip
        matmuls = c.row(model, "@remat(policy=save_matmuls)")
        if matmuls and decorator and none:
            c.add("5.4", f"{model}: save_matmuls time overhead / full remat's",
                  _per_repeat(lambda s, f, n: (s - n) / (f - n), matmuls, decorator, none), 0.5, "≤ 0.5")
            if matmuls.peak_bytes and decorator.peak_bytes and none.peak_bytes:
                between = decorator.peak_bytes <= matmuls.peak_bytes <= none.peak_bytes
                c.found.append(Check("5.4", f"{model}: save_matmuls peak between full remat and none",
                                     matmuls.peak_bytes / none.peak_bytes, matmuls.peak_bytes / none.peak_bytes,
                                     matmuls.peak_bytes / none.peak_bytes, "full ≤ it ≤ none", between))
    chain, chain_summary = c.row("chain", CHAIN), summary or {}
    if chain is not None and "peak_over_budget" in chain_summary:
        c.add_value("5.5", "chain: measured peak / budget", float(chain_summary["peak_over_budget"]),  # type: ignore[arg-type]
                    1.05, "≤ 1.05")  # fmt: skip
        best = next((row for (model, config), row in c.by_key.items()
                     if model == "chain" and config.endswith("(best fitting)")), None)  # fmt: skip
        if best is not None:
            c.add("5.5", "chain: step / best fitting checkpoint_sequential's",
                  _per_repeat(lambda a, b: a / b, chain, best), 0.95, "≤ 0.95x")  # fmt: skip
        error = abs(float(chain_summary.get("predicted_over_measured", 0.0)) - 1)  # type: ignore[arg-type]
        c.add_value("5.5", "chain: |predicted / measured time - 1|", error, 0.15, "≤ 0.15")
    _offload_targets(c)
    imported = c.row("startup", "import remat (after torch)")
    if imported and imported.step_seconds:
        c.add("5.6", "import remat after torch (s)", imported.step_seconds, 0.050, "≤ 0.050 s")
    first = c.row("startup", "first @remat call, forward+backward")
    if first and first.step_seconds:
        c.add("5.6", "first @remat call (s)", first.step_seconds, 0.1, "≤ 0.1 s (no one-off set-up)")
    return c.found


def _offload_targets(c: _Checks) -> None:
    """§5.9 on the offload rows (an accelerator's run: on CPU they are skipped)."""
    blocks, theirs = c.row("offload", "per-block remat"), c.row("offload", SAVE_ON_CPU)
    alone, offloaded = c.row("offload", "remat.offload()"), c.row("offload", "per-block remat, offload=True")
    if alone and theirs:
        c.add("5.9", "offload: remat.offload() step / save_on_cpu's", _per_repeat(lambda a, b: a / b, alone, theirs),
              1.0, "≤ 1.00x")  # fmt: skip
        if alone.peak_bytes and theirs.peak_bytes:
            c.add_value("5.9", "offload: remat.offload() peak / save_on_cpu's", alone.peak_bytes / theirs.peak_bytes,
                        1.05, "≤ 1.05x")  # fmt: skip
    if offloaded and blocks:
        c.add("5.9", "offload: per-block offload=True step / per-block remat's",
              _per_repeat(lambda a, b: a / b, offloaded, blocks), 1.03, "≤ 1.03x")  # fmt: skip
        offloaded_bytes = (offloaded.traffic or {}).get("out_bytes")
        if offloaded.peak_bytes and blocks.peak_bytes and offloaded_bytes:
            floor = blocks.peak_bytes - 0.8 * offloaded_bytes
            c.add_value("5.9", "offload: per-block offload=True peak / (per-block remat's - 0.8 x offloaded)",
                        offloaded.peak_bytes / floor if floor > 0 else float("inf"), 1.0, "≤ 1.00")  # fmt: skip
    for row in (alone, offloaded, c.row("offload", "per-block offload(save_matmuls)")):
        moved = row.traffic if row else None
        if row is None or not moved or not moved.get("out"):
            continue
        name = row.config
        crossings = ((moved["back"] or 0) + (moved["kept"] or 0)) / float(moved["out"] or 1)
        c.found.append(Check("5.9", f"offload: {name}: (copies back + not brought back) / copies to host",
                             crossings, crossings, crossings, "= 1 (each copy once each way)", crossings == 1))
        pageable = float(moved["pageable"] or 0)
        c.found.append(Check("5.9", f"offload: {name}: copies with pageable memory", pageable, pageable, pageable,
                             "= 0", pageable == 0))  # fmt: skip
        memcpy = (row.profile or {}).get("memcpy", {})
        staged = sum(n for kind, (n, _) in memcpy.items() if "Pageable" in kind)
        if memcpy:
            c.found.append(Check("5.9", f"offload: {name}: pageable copies in the profile", staged, staged, staged,
                                 "= 0", staged == 0))  # fmt: skip


def format_checks(checks: Sequence[Check]) -> str:
    """The targets as an aligned table: what, median [spread], target, ✓/✗."""
    if not checks:
        return ""
    table = [("target", "measured (median [low..high] over repeats)", "bound", "")]
    for check in checks:
        spread = "" if check.low == check.high else f" [{check.low:.3g}..{check.high:.3g}]"
        # 4 decimals: a ratio of 1.0005 against a bound of 1.00 must not read "1"
        median = f"{check.median:.4f}" if abs(check.median) >= 0.01 else f"{check.median:.3g}"
        table.append((check.what, median + spread, check.target, "✓" if check.ok else "✗"))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [
        "Targets: remat's own goals, a check for its developers (`python -m benchmarks --check` exits with status 1",
        "when one does not hold). Each is a ratio of two rows measured in this run; timing rows on a small or busy",
        "shared CPU are noisy and may miss a target from one run to the next. Nothing here needs your attention:",
        "a row that fails (its call raised, or its gradients differ from no remat's) is listed separately.",
    ]
    for i, row in enumerate(table):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("-" * len(lines[-1]))
    held = sum(check.ok for check in checks)
    lines.append(f"{held} of {len(checks)} targets hold in this run (see above for what that means).")
    return "\n".join(lines)
