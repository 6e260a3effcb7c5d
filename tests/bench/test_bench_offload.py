"""The offload rows of the benchmark (`python -m benchmarks --model offload`, benchmarks/offload.py), on CPU."""

from __future__ import annotations

import io

import torch

import remat
from benchmarks.cli import main
from benchmarks.offload import NEEDS_ACCELERATOR, SAVE_ON_CPU, bench_offload, format_offload
from benchmarks.runner import Result
from benchmarks.targets import check_targets
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
            torch.device("cpu"), 1, lambda message: None, config=TINY, offload=remat.offload(include_cpu=True),
            profile=True,
        )
    finally:
        torch.set_num_threads(threads)
    assert "CPU path" in description
    by_name = {row["config"]: row for row in rows}
    assert list(by_name) == [
        "no remat", "per-block remat", "save_on_cpu(pin_memory=True)", "remat.offload()",
        "per-block remat, offload=True", "per-block remat, offload=True, 256 MiB in flight",
        "per-block offload(save_matmuls)",
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

    # The copies between device and host in the measured step: ours each once each way, none pageable; torch's
    # save_on_cpu counted in its hooks; nothing for the rows that do not offload (policies.offload takes the
    # default settings, which pass CPU tensors through).
    for name in ("remat.offload()", "per-block remat, offload=True"):
        moved = by_name[name]["traffic"]
        assert moved["out"] > 0 and (moved["back"], moved["back_bytes"]) == (moved["out"], moved["out_bytes"]), name
        assert moved["kept"] == moved["pageable"] == 0, name
        assert f"copies {moved['out']}/{moved['out']}/0/0" in by_name[name]["note"]
    theirs = by_name[SAVE_ON_CPU]["traffic"]
    assert theirs["out"] > 0 and theirs["back"] == theirs["out"] and theirs["pageable"] is None
    none = ("no remat", "per-block remat", "per-block offload(save_matmuls)")
    assert {by_name[name]["traffic"]["out"] for name in none} == {0}
    # q, k and v of each block cross as one copy: offload alone makes fewer copies than save_on_cpu
    assert by_name["remat.offload()"]["traffic"]["out"] < theirs["out"]
    # one profiled step per row
    for row in rows:
        assert row["profile"]["seconds"] > 0 and row["profile"]["host_top"], row["config"]
    section = format_offload(rows)
    assert "copies: to host" in section and "profiled step" in section and "most host time: aten::" in section
    # and the targets of spec 5.9 that a CPU run can check: each copy once each way, nothing pageable
    results = [Result("offload", **{k: v for k, v in row.items() if k != "host_bytes"}) for row in rows]
    checks = [check for check in check_targets(results) if check.section == "5.9"]
    counted = [check for check in checks if "copies" in check.what]
    assert len(counted) == 4 and all(check.ok for check in counted), counted
    assert any("save_on_cpu's" in check.what for check in checks)
