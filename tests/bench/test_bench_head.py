"""The head's rows of the benchmark (`python -m benchmarks --model head`, benchmarks/head.py), on a small batch."""

from __future__ import annotations

import subprocess

import pytest

from benchmarks import head_families
from benchmarks.head import CONFIGS, format_result, format_sweep, measure, sweep

pytest.importorskip("transformers")


@pytest.mark.slow  # every row of the head's benchmark: NOTE [ Slow tests ] in tests/conftest.py
def test_every_row_runs_with_the_gradients_of_no_remat() -> None:
    result = measure(repeats=1, batch=1, seq=64)  # the real vocabulary, few tokens: a quick run
    rows = result["rows"]
    assert list(rows) == list(CONFIGS)
    none, full, head = (rows[label] for label in CONFIGS)
    assert full["grads_equal"] and head["grads_equal"]
    assert min(none["peak_bytes"], full["peak_bytes"], head["peak_bytes"]) > 0  # at 64 tokens the peak is the
    # gradients': tests/sites/test_head.py checks what the head saves
    text = format_result(result)
    assert "target: gradients equal no remat's (float64): ok" in text


@pytest.mark.slow  # runs a benchmark: NOTE [ Slow tests ] in tests/conftest.py
def test_the_sweep_has_a_row_per_rows_of_a_chunk_and_times_a_revision() -> None:
    try:
        subprocess.run(["git", "rev-parse", "HEAD"], check=True, capture_output=True)
        against: str | None = "HEAD"
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: no revision to time against
        against = None
    cases = sweep(repeats=1, tokens=64, rows=(16, 32), against=against)
    assert [case["label"] for case in cases] == ["F.cross_entropy(F.linear(...))", "16 rows", "32 rows",
                                                 "64 rows (chunks=None)"]
    assert [case["chunks"] for case in cases] == [0, 4, 2, 1] and all(case["peak_bytes"] > 0 for case in cases)
    assert all(("before_seconds" in case) == (against is not None) for case in cases[1:])
    text = format_sweep(cases, tokens=64, against=against)
    assert "vs plain" in text and ("now/then" in text) == (against is not None)


@pytest.mark.slow  # runs a benchmark: NOTE [ Slow tests ] in tests/conftest.py
def test_the_families_sweep_tells_equal_from_refused() -> None:
    """`python -m benchmarks.head_families` on three families: OPT reads its logits (`contiguous()`) and gives its own
    loss, MusicGen's list of heads is refused saying what it is."""
    results = head_families.sweep(["opt", "gpt2", "musicgen"])
    assert results["opt"] == head_families.Outcome("equal", "float64")
    assert results["gpt2"].kind == "equal"
    assert results["musicgen"].kind == "refused" and "a list of 4 heads" in results["musicgen"].detail
    assert "DIFFERS 0" in head_families.format_sweep(results)


@pytest.mark.slow  # runs a benchmark: NOTE [ Slow tests ] in tests/conftest.py
def test_the_families_sweep_with_tiles_finds_each_family_equal_and_tiled() -> None:
    """`python -m benchmarks.head_families --tiles 3`: openai-gpt's post-norm blocks (gradients wrong before the
    chain was made alike in forward and the recompute), Bloom's MLP that takes the residual (tiled with its input;
    its first step failed on a shape before), Qwen2-MoE's norms (taken for experts before)."""
    results = head_families.sweep(["openai-gpt", "bloom", "qwen2_moe"], tiles=3)
    assert results["openai-gpt"] == head_families.Outcome("equal", "float64, 6 modules tiled")
    assert results["bloom"] == head_families.Outcome("equal", "float64, 6 modules tiled")
    assert results["qwen2_moe"].kind == "equal" and results["qwen2_moe"].detail.endswith("4 modules tiled")
    assert "head=True, tiles=3" in head_families.format_sweep(results, tiles=3)
