"""The offload rows of the benchmark (`python -m benchmarks --model offload`, benchmarks/offload.py), on CPU."""

from __future__ import annotations

import io

import torch

import remat
from benchmarks.cli import main
from benchmarks.offload import NEEDS_ACCELERATOR, bench_offload
from remat._demo import GPTConfig

TINY = GPTConfig(blocks=2, d=32, heads=2, seq=16, batch=2, vocab=50)


def test_on_cpu_offload_says_it_needs_an_accelerator_and_skips_its_rows() -> None:
    out = io.StringIO()
    assert main(["--model", "offload", "--repeats", "1", "--quiet"], stdout=out) == 0
    text = out.getvalue()
    assert NEEDS_ACCELERATOR in text
    assert not [line for line in text.splitlines() if line.startswith("offload ")], "a row ran on CPU"
    assert bench_offload(torch.device("cpu"), 1, lambda message: None) == (NEEDS_ACCELERATOR, [])


def test_every_row_runs_and_matches_no_remat_through_the_cpu_path() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps on a busy machine: one thread does not stall
    try:
        description, rows = bench_offload(
            torch.device("cpu"), 1, lambda message: None, config=TINY, offload=remat.offload(include_cpu=True)
        )
    finally:
        torch.set_num_threads(threads)
    assert "CPU path" in description
    by_name = {row["config"]: row for row in rows}
    assert list(by_name) == [
        "no remat", "per-block remat", "save_on_cpu(pin_memory=True)", "remat.offload()",
        "per-block remat, offload=True", "per-block offload(save_matmuls)",
    ]
    for row in rows:
        assert not row["note"].startswith("failed"), row
        assert len(row["step_seconds"]) == 1
        assert row["grad_diff"] is not None and row["grad_diff"] < 1e-5, row["config"]
    assert by_name["no remat"]["host_bytes"] == 0
    # offload alone copies every activation; per-block remat with offload only the blocks' inputs
    alone, blocks = by_name["remat.offload()"]["host_bytes"], by_name["per-block remat, offload=True"]["host_bytes"]
    assert 0 < blocks < alone
    assert by_name["remat.offload()"]["peak_bytes"] < by_name["no remat"]["peak_bytes"]
