"""`python -m remat`: the user's first look (a short demonstration on the built-in GPT-like model) and `estimate`;
the benchmark lives outside the package (`benchmarks/`, `python -m benchmarks`) and `import remat` never loads it."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import remat
from remat.__main__ import BUDGET_LABEL, HEAD_LABEL, main

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(remat.__file__).resolve().parent
ROWS = ("no remat", "torch.utils.checkpoint, every block", "remat.apply(model)",
        "remat.apply(model, policy=save_matmuls)", BUDGET_LABEL, HEAD_LABEL)


def _python_m_remat(*flags: str) -> str:
    done = subprocess.run([sys.executable, "-m", "remat", *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def _rows(out: str) -> dict[str, list[str]]:
    """The table's rows by configuration: peak, its ratio to no remat's, step, its ratio, gradients equal."""
    rows = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] in ROWS and len(cells) == 6:
            rows[cells[0]] = cells[1:]
    return rows


def _ratio(cell: str) -> float:
    assert cell.endswith("x"), cell
    return float(cell[:-1])


@pytest.mark.slow  # `python -m remat` in a subprocess: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.equivalence
def test_python_m_remat_shows_what_remat_saves_in_one_screen() -> None:
    out = _python_m_remat("--quick")
    assert len(out.splitlines()) <= 60, out
    assert "gradients equal" in out and "GPT-like model" in out
    rows = _rows(out)
    assert list(rows) == list(ROWS), out
    assert rows["no remat"][4] == "(the reference)"
    assert [rows[label][4] for label in ROWS[1:]] == ["yes"] * 5, out  # the same gradients as no remat's
    assert _ratio(rows["no remat"][1]) == 1.0
    full = _ratio(rows["remat.apply(model)"][1])
    assert full < 0.75, out  # remat was active: the step held less than without it
    assert full <= _ratio(rows["torch.utils.checkpoint, every block"][1]) * 1.02, out
    assert full <= _ratio(rows["remat.apply(model, policy=save_matmuls)"][1]) < 1.0, out
    assert _ratio(rows[BUDGET_LABEL][1]) <= 0.5 * 1.05, out  # the budget's promise, from its first step
    assert _ratio(rows[HEAD_LABEL][1]) <= full, out  # the head in chunks holds no more than full remat
    for line in ("python -m benchmarks", "python -m remat estimate", "remat.apply(model, budget=0.5, sample=x)",
                 "with remat.region():", "@remat", "remat.linear_cross_entropy(", "head=True"):
        assert line in out, line


def test_python_m_remat_refuses_a_device_it_cannot_use(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "nonsense"]) == 2
    assert capsys.readouterr().err.startswith("remat: cannot use --device nonsense: ")
    with pytest.raises(SystemExit):
        main(["--threads", "0"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_python_m_remat_on_cuda() -> None:
    out = _python_m_remat("--quick", "--device", "cuda")
    assert "cuda" in out.splitlines()[0]
    assert [cells[4] for cells in _rows(out).values()][1:] == ["yes"] * 5, out


def test_python_m_remat_estimate_prints_the_built_in_models_table() -> None:
    out = io.StringIO()
    assert main(["estimate", "--model", "convnet", "--optimizer", "none"], out) == 0
    text = out.getvalue()
    assert text.startswith("convnet (6 blocks, width 16-64"), text
    assert "remat.estimate: ConvNet, one training step" in text
    assert all(f"\n{config} " in text for config in ("none", "full", "save_matmuls")), text


def test_import_remat_loads_no_benchmark_and_no_built_in_model() -> None:
    probe = ("import sys, remat; print(' '.join(m for m in sys.modules if m.split('.')[0] in ('benchmarks', "
             "'tests', 'models') or m in ('remat._demo', 'remat._estimate_cli', 'remat.__main__')))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-800:]
    assert done.stdout.split() == []


def test_the_package_holds_no_benchmark_and_imports_none() -> None:
    assert not list(PACKAGE.glob("bench/**/*.py"))  # (a checkout from before the move may keep its __pycache__)
    assert (ROOT / "benchmarks" / "__main__.py").exists()
    outside = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            outside += [f"{path.relative_to(PACKAGE)}: {name}" for name in names
                        if name.split(".")[0] in ("benchmarks", "tests", "models")]
    assert outside == []
