"""The GPU check (`python -m benchmarks --model gpu`, benchmarks/gpu_check.py) at its tiny CPU sizes: every row runs
and every check that holds on a CPU holds, so that the command is ready for a GPU."""

from __future__ import annotations

import io
import re

import pytest

from benchmarks.cli import main
from benchmarks.gpu_check import BUDGETS, CONFIGS, LONG_CONFIGS, LONG_TINY, TINY, UNIFORM

pytestmark = pytest.mark.slow  # the GPU check's every row at tiny sizes: NOTE [ Slow tests ] in tests/conftest.py

pytest.importorskip("transformers")


def test_the_gpu_check_runs_every_row_at_tiny_sizes_on_the_cpu() -> None:
    out = io.StringIO()
    status = main(["--model", "gpu", "--quiet"], stdout=out)
    text = out.getvalue()
    assert status == 0, text
    lines = text.splitlines()
    assert lines[0].startswith("GPU check: CPU") and "tiny sizes" in lines[0]
    planned_somewhere = False
    assert "failed:" not in text and "FAILS" not in text, text
    for shape in TINY:
        rows = [line for line in lines if line.startswith(shape.name)]
        for label in CONFIGS:
            assert any(f"  {label}  " in row and "peak " in row for row in rows), (label, text)
            if label != "no remat":  # NOTE [ What the GPU check measures ], rule 2b
                assert any(f"  {label}  " in row and "from no remat's" in row for row in rows), (label, text)
        for config in ("none", "full", "save_matmuls"):
            assert any(f"estimate {config} " in row and row.endswith("ok") for row in rows), text
        for fraction in BUDGETS:
            assert any(f"budget {fraction} " in row for row in rows), text
            planned = any(re.search(rf"  budget {fraction}\s+budget ", row) for row in rows)  # not refused
            if planned:  # NOTE [ What the GPU check measures ], rule 4b
                assert any(f"target: budget {fraction} " in row and ("fastest uniform" in row or "no uniform" in row)
                           for row in rows), text
                assert any(f"budget {fraction} time " in row and "predicted/measured" in row for row in rows), text
                fitting = [row for row in rows if f"budget {fraction} against " in row]
                assert all(any(u in row for u in UNIFORM) and "x its (its peak" in row for row in fitting), text
                planned_somewhere = True
        assert sum("memory=" in row for row in rows) == len(shape.memory)
    assert planned_somewhere, "no budget was planned: the plan-time rows went untested"
    long = [line for line in lines if line.startswith(LONG_TINY.name)]  # NOTE [ What the GPU check measures ], rule 6
    for label in LONG_CONFIGS:
        assert any(f"long: {label}  " in row and "KiB/token" in row for row in long), (label, text)
    assert any("4x transformers' longest" in row for row in long), text
    assert lines[-1].startswith("every check holds")


def test_the_long_rows_profile_runs_at_tiny_sizes_on_the_cpu() -> None:
    import torch

    from benchmarks.gpu_check import profile_long

    out = io.StringIO()
    profile_long(torch.device("cpu"), out)
    text = out.getvalue()
    for label in ("remat full + head,", "remat full + head + tiles,"):
        assert f"{LONG_TINY.name}, {label}" in text, text
    assert text.count("Self CPU time total") == 2 and "_TilesFunctionBackward" in text, text
