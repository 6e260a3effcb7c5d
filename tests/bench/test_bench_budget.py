"""Tests of `python -m remat --model budget`'s table, torch.compile column and plot, on small fake results; of the
families' sweep (`python -m benchmarks.budget_families`)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import budget, budget_compile, budget_families
from benchmarks.budget import Row
from benchmarks.cli import main


def _rows() -> list[Row]:
    return [
        Row("gpt", "no remat", peak=100 * 2**20, times=[1.0]),
        Row("gpt", "full remat, every 1", peak=20 * 2**20, times=[1.5]),
        Row("gpt", "remat budget 50%", fraction=0.5, budget=50 * 2**20, peak=48 * 2**20, predicted_peak=48 * 2**20,
            predicted_time=1.25, plan_seconds=1.5, choices="F K", times=[1.2]),
        Row("gpt", "remat budget 100%", fraction=1.0, budget=100 * 2**20, peak=100 * 2**20, choices="K K",
            times=[1.0]),
        Row("convnet", "no remat", peak=10 * 2**20, times=[0.1]),
        Row("convnet", "remat budget 80%", fraction=0.8, budget=8 * 2**20, peak=7 * 2**20, times=[0.12]),
    ]


THEIRS: dict[float, dict[str, Any]] = {
    1.0: {"peak": 80 * 2**20, "step": 0.5, "compile_seconds": 20.0},
    0.5: {"peak": 40 * 2**20, "step": 0.6, "compile_seconds": 22.0},
    0.2: {"error": "InductorError: boom"},
}


def test_the_tables_show_both_sides_relative_to_their_own_baselines() -> None:
    text = budget.format_table(_rows(), {})
    assert "remat budget" not in text and "50%" in text and "full remat, every 1 (1500)" in text
    compiled = budget.format_compile(_rows(), THEIRS)
    line = next(row for row in compiled.splitlines() if row.strip().startswith("50%"))
    # compile: 40 MiB, 0.50 of its own peak, 600 ms, 1.20 of its own time; ours: 0.48 of none's peak, 1.20 of its time
    assert line.split() == ["50%", "40.00", "0.50", "600", "1.20", "0.48", "1.20"]
    assert "failed: InductorError: boom" in compiled
    assert "compiling took 20-22 s per fraction" in compiled


def test_a_failed_compile_baseline_is_one_line_and_stops_the_column(monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[float] = []

    def runner(fraction: float, size: str, repeats: int, threads: int) -> dict[str, Any]:
        tried.append(fraction)
        return {"error": "CppCompileError: no C++ compiler"}

    theirs = budget_compile.compile_column([0.2, 0.5], "small", 1, 1, runner=runner)
    assert tried == [1.0]
    assert budget.format_compile(_rows(), theirs) == (
        "torch.compile column not available: CppCompileError: no C++ compiler"
    )


def test_the_compile_subprocess_reports_a_reason_not_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def timeout(*args: Any, **kwargs: Any) -> Any:
        raise subprocess.TimeoutExpired(cmd="python", timeout=kwargs["timeout"])

    monkeypatch.setattr(subprocess, "run", timeout)
    assert budget_compile.run_fraction(0.5, "small", 1, 1, timeout=3) == {"error": "timed out after 3 s"}

    def crashed(*args: Any, **kwargs: Any) -> Any:
        return subprocess.CompletedProcess(args, -9, stdout="", stderr="Traceback ...\nMemoryError\n")

    monkeypatch.setattr(subprocess, "run", crashed)
    assert budget_compile.run_fraction(0.5, "small", 1, 1) == {"error": "MemoryError"}


def test_the_compile_subprocess_is_given_the_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake(argv: list[str], **kwargs: Any) -> Any:
        seen.append(argv)
        assert kwargs["env"]["MALLOC_MMAP_THRESHOLD_"] == "131072"
        return subprocess.CompletedProcess(argv, 0, stdout='{"peak": 1, "step": 2.0}\n', stderr="")

    monkeypatch.setattr(subprocess, "run", fake)
    assert budget_compile.run_fraction(0.3, "small", 2, 3) == {"peak": 1, "step": 2.0}
    assert seen[0][-4:] == ["0.3", "small", "2", "3"]
    assert "torch.set_num_threads(threads)" in budget_compile.SCRIPT


def test_plot_writes_a_png_of_every_model(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "budget.png"
    budget.plot(_rows(), THEIRS, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image  # matplotlib depends on pillow

    with Image.open(path) as image:
        assert image.width > image.height  # two panels side by side: gpt and convnet


def test_plot_without_matplotlib_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it now fails, and find_spec finds nothing
    with pytest.raises(RuntimeError, match=r"^remat: --plot needs matplotlib.*pip install matplotlib"):
        budget.plot(_rows(), THEIRS, str(tmp_path / "x.png"))
    assert main(["--model", "budget", "--plot", str(tmp_path / "x.png"), "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("remat: --plot needs matplotlib")
    assert not (tmp_path / "x.png").exists()


def test_a_families_row_keeps_the_promise_within_its_slack_and_refuses_only_below_full_remat() -> None:
    row = budget_families.Row
    assert row("llama", "eager", 1.05, (1.0499, 0.95, 0.95), 0.98).kept_promise
    assert not row("llama", "eager", 1.05, (1.0501, 0.95, 0.95), 0.98).kept_promise
    assert row("llama", "eager", 0.9, (), None, "no choice fits").kept_promise  # below full remat: a true refusal
    assert not row("llama", "eager", 1.0, (), None, "no choice fits").kept_promise
    assert "OVER" in budget_families.format_row(row("gpt2", "sdpa", 1.0, (1.07, 1.0, 1.0), 0.93))


@pytest.mark.slow  # plans and trains a transformers model at 1,024 tokens: NOTE [ Slow tests ] in tests/conftest.py
def test_the_families_sweep_runs_a_family_and_exits_zero_where_the_promise_holds() -> None:
    pytest.importorskip("transformers")
    out = io.StringIO()
    status = budget_families.main(["--family", "llama", "--attention", "eager", "--fraction", "1.05"], out)
    lines = out.getvalue().splitlines()
    assert status == 0, out.getvalue()
    assert lines[-1].startswith("1 of 1 rows keep the promise")
    assert lines[2].split()[:3] == ["llama", "eager", "1.05"]
