"""The head's rows of the benchmark (`python -m benchmarks --model head`, benchmarks/head.py), on a small batch."""

from __future__ import annotations

import io

import pytest

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


def test_the_sweep_has_a_row_per_chunk_size() -> None:
    rows = sweep(repeats=1, tokens=64)
    labels = [label for label, _, _ in rows]
    assert labels[0] == "F.cross_entropy(F.linear(...))" and "chunks of 64 MiB (chunks=None)" in labels
    out = io.StringIO()
    out.write(format_sweep(rows))
    assert "vs plain" in out.getvalue()
