"""The README's examples run (the slower ones are covered by their own tests: tutorial loop, chains)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the examples run whole: NOTE [ Slow tests ] in tests/conftest.py

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["region_block", "transformer"])
def test_example_runs(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert out.strip(), "the example printed nothing"
    if name == "region_block":
        assert "num_batches_tracked = 1" in out
    else:
        assert out.count("gradients equal") == 3


def test_fit_budget_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(EXAMPLES / "fit_budget.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "budget 0.5" in out and "6 blocks under a budget" in out
    assert "measured on one real step: step peak" in out  # the first training step checked the plan
    words = out.split("tracked peak of a step: ")[1].split()  # "<a> MiB with the budget, <b> MiB without"
    fitted, none = float(words[0]), float(words[5])
    assert fitted < none
    assert out.count("step ") >= 3


def test_hf_finetune_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    runpy.run_path(str(EXAMPLES / "hf_finetune.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "4 rematerialized sites" in out and "LlamaDecoderLayer" in out
    assert "remat on" in out and "remat off" in out
    losses = [float(line.split()[-1]) for line in out.splitlines() if re.match(r"step \d+: loss ", line)]
    assert len(losses) == 3 and losses[-1] < losses[0]
