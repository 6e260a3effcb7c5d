"""Tests for the benchmark `python -m benchmarks` (benchmarks/cli.py and the models it runs), on tiny sizes."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks import cli as _bench
from benchmarks.chain import CHAIN, bench_chain
from benchmarks.cli import CONFIGS, NO_REMAT, TORCH, Config, Result, format_table, main, register, run
from benchmarks.runner import bench_model, tiny
from benchmarks.tiny import bench_replay
from remat._demo import GPT, BenchModel, ConvNet, ConvNetConfig, GPTConfig, human_count
from tests.models import CHAIN_SIZES, ChainNet, ChainNetConfig

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny models on a busy machine: with two OpenMP threads, a step can stall for a scheduler
    # quantum (measured: 10 ms steps taking 0.3-1 s); one thread keeps these tests fast.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


TINY_GPT = GPTConfig(blocks=2, d=16, heads=2, seq=8, batch=2, vocab=20)
TINY_CONVNET = ConvNetConfig(width=4, blocks_per_stage=1, image=8, batch=4)
# Narrow and wide images: activations dominate parameters, as in the small size. (With width 4 on
# 16x16 images the parameters' gradients, which the chain holds as a second copy until its backward
# returns, are larger than the activation budget, and the chain's peak is 2.3x its budget.)
TINY_CHAIN = ChainNetConfig(width=2, image=64, batch=2)


def _rows(model: BenchModel, name: str, configs: list[Config] | None = None) -> dict[str, Result]:
    torch.manual_seed(0)
    results = bench_model(name, model, CPU, 1, configs or CONFIGS, lambda message: None)
    return {r.config: r for r in results}


@pytest.mark.parametrize("model", [GPT(TINY_GPT), ConvNet(TINY_CONVNET)], ids=["gpt", "convnet"])
def test_every_configuration_matches_no_remat(model: BenchModel) -> None:
    rows = _rows(model, "m")
    none, theirs = rows[NO_REMAT], rows[TORCH]
    assert none.peak_bytes is not None and none.held_bytes is not None
    assert theirs.held_bytes is not None and theirs.held_bytes < none.held_bytes
    for row in rows.values():
        assert not row.error, row.note
        assert len(row.step_seconds) == 1 and row.step is not None
        assert row.grad_diff is not None and row.grad_diff < 1e-5, row.config


def test_a_configuration_that_raises_is_a_failed_row() -> None:
    def missing(model: BenchModel) -> str | None:
        raise ImportError("no module named remat._future")

    def broken(model: BenchModel) -> str | None:
        def call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

        model.call = call
        return "a note that the failure replaces"

    configs = [
        CONFIGS[0],
        Config("future", missing),
        Config("broken", broken),
        Config("gpt only", lambda m: None, models=("gpt",)),
    ]
    rows = _rows(ConvNet(TINY_CONVNET), "convnet", configs)
    assert rows["future"].error.startswith("ImportError: no module named remat._future")
    assert rows["future"].note == "FAILED: " + rows["future"].error
    assert rows["broken"].error == "RuntimeError: boom" and rows["broken"].note == "FAILED: RuntimeError: boom"
    assert rows["broken"].step is None and rows["future"].step is None
    assert not rows[NO_REMAT].error
    assert "gpt only" not in rows


def test_register_replaces_by_name() -> None:
    before = list(CONFIGS)
    try:
        register(Config("extra", lambda m: None))
        register(Config("extra", lambda m: None, models=("tiny",)))
        assert [c.name for c in CONFIGS].count("extra") == 1
        assert CONFIGS[-1].models == ("tiny",)
    finally:
        CONFIGS[:] = before


def test_tiny_overhead_rows() -> None:
    meta, rows = run(["tiny"], repeats=1, startup=False)
    by_name = {r.config: r for r in rows}
    assert {NO_REMAT, TORCH} <= set(by_name)
    for row in rows:
        assert not row.error, row.note
        if not row.compare:
            continue
        assert row.step is not None and row.step > 0
        assert row.grad_diff == 0.0
        if row.config not in (NO_REMAT, TORCH) and by_name[TORCH].step > by_name[NO_REMAT].step:  # type: ignore[operator]
            assert row.note.startswith("overhead ")
    assert "tiny" in meta["models"]


def test_table_is_aligned_and_has_ratios() -> None:
    meta = {
        "date": "d",
        "device": "cpu",
        "threads": 2,
        "torch": "t",
        "size": "small",
        "repeats": 1,
        "models": {"m": "x"},
    }
    rows = [
        Result("m", NO_REMAT, 4096, 2048, [0.010], 0.0),
        Result("m", TORCH, 1024, 512, [0.020], 0.0),
        Result("m", "@remat", 1024, 512, [0.015], 1e-7, "a note"),
        Result("m", "remat.region", note="FAILED: ImportError: x", error="ImportError: x"),
    ]
    text = format_table(meta, rows)
    lines = text.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("model"))) :]
    assert len({line.index("configuration") for line in table[:1]}) == 1
    assert "0.25x" in text and "1.50x" in text and "0.75x" in text and "1.0e-07" in text
    assert table[-1].rstrip().endswith("FAILED: ImportError: x")
    assert "warning" not in text
    noisy = format_table(meta, [Result("m", NO_REMAT, step_seconds=[0.1, 0.1, 0.9])])
    assert "warning: the step times of 1 row varied more than 2x" in noisy
    # Every data row puts its numeric columns at the same place.
    ends = {len(line.split("  a note")[0]) for line in table[2:4]}
    assert len(ends) == 1


def test_main_prints_one_table_and_writes_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_bench, "bench_startup", lambda progress: [])
    out = io.StringIO()
    path = tmp_path / "bench.json"
    status = main(["--model", "tiny", "--repeats", "1", "--json", str(path), "--quiet"], stdout=out)
    assert status == 0
    text = out.getvalue()
    assert text.startswith("remat benchmark")
    assert "torch.utils.checkpoint" in text
    data = json.loads(path.read_text())
    assert data["meta"]["size"] == "small"
    assert {r["config"] for r in data["rows"]} >= {NO_REMAT, TORCH}


@pytest.mark.slow  # fresh interpreters: NOTE [ Slow tests ] in tests/conftest.py
def test_startup_rows_time_a_fresh_process() -> None:
    meta, rows = run([], startup=True)
    assert [r.model for r in rows] == ["startup", "startup"]
    for row in rows:
        assert not row.error, row.note
        assert row.step is not None and 0 < row.step < 60
    assert "startup" in meta["models"]


def test_replay_row_reports_overhead_per_op() -> None:
    rows = bench_replay(CPU, 1, lambda message: None, calls=2)
    assert [row.config for row in rows] == [
        "empty TorchDispatchMode forward, per op", "remat.region forward, per op",
        "empty TorchDispatchMode forward, per op, with grad", "remat.region forward, per op, with grad",
    ]
    for row in rows:
        assert row.step is not None and not row.compare
    assert "per recorded op" in rows[1].note and "floor" in rows[0].note


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed")
def test_plot_without_matplotlib_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "tiny", "--plot", "x.png", "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("remat: --plot needs matplotlib")


def test_bad_device_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "nonsense", "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("remat: cannot use --device nonsense")


def test_models_and_helpers() -> None:
    gpt = GPT(TINY_GPT)
    assert gpt.loss(*gpt.sample(CPU)).dim() == 0
    assert "2 blocks" in gpt.describe()
    conv = ConvNet(TINY_CONVNET)
    assert any(isinstance(m, nn.BatchNorm2d) for m in conv.blocks.modules())
    assert conv.loss(*conv.sample(CPU)).dim() == 0
    assert tiny(torch.zeros(3)).tolist() == [0.0, 0.0, 0.0]
    assert (human_count(999), human_count(1234), human_count(2_700_000)) == ("999", "1.2K", "2.7M")


def test_plot_draws_one_panel_per_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from unittest import mock

    fake = mock.MagicMock()
    fig, ax = mock.MagicMock(), mock.MagicMock()
    fake.pyplot.subplots.return_value = (fig, [[ax]])
    monkeypatch.setitem(sys.modules, "matplotlib", fake)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", fake.pyplot)
    meta = {"date": "d", "device": "cpu", "models": {"gpt": "x", "tiny": "y"}}
    rows = [Result("gpt", NO_REMAT, 2**20, 2**19, [0.5]), Result("tiny", NO_REMAT, step_seconds=[1e-4])]
    _bench.plot(meta, rows, str(tmp_path / "p.png"))
    fake.use.assert_called_once_with("Agg")
    ax.scatter.assert_called_once_with(500.0, 1.0)
    fig.savefig.assert_called_once()


@pytest.mark.slow  # runs a benchmark: NOTE [ Slow tests ] in tests/conftest.py
def test_chain_mode_measures_the_chain_against_checkpoint_sequential() -> None:
    description, summary, rows = bench_chain(ChainNet(TINY_CHAIN), CPU, 1, lambda message: None)
    assert "14 stages" in description
    by_name = {r.config: r for r in rows}
    none, ours = by_name[NO_REMAT], by_name[CHAIN]
    for row in rows:
        assert not row.error, row.note
        assert row.step is not None and row.peak_bytes is not None
        assert row.grad_diff is not None and row.grad_diff < 1e-5, row.config
    assert ours.peak_bytes is not None and none.peak_bytes is not None and ours.peak_bytes < none.peak_bytes
    # docs/benchmarks.md, target 'chain: measured peak / budget': the measured peak (plus the chain's input, which
    # the budget counts) within the budget + 5%.
    assert summary["peak_over_budget"] <= 1.05, summary
    assert summary["budget_bytes"] * 2 <= summary["no_remat_predicted_peak_bytes"] + 1
    assert summary["predicted_seconds"] > 0 and summary["predicted_over_measured"] > 0
    assert [entry["segments"] for entry in summary["sweep"]] == list(range(1, 15))
    assert "peak+input/budget" in ours.note and "predicted/measured time" in ours.note
    best = summary["best_sequential"]
    if best is None:
        assert "no checkpoint_sequential fits" in ours.note
    else:
        fitting = [r for r in rows if r.config.endswith("(best fitting)")]
        assert len(fitting) == 1 and fitting[0].peak_bytes is not None
        assert fitting[0].peak_bytes <= ours.peak_bytes
        assert "chain time/this" in fitting[0].note
        assert summary["chain_over_sequential"] == pytest.approx(ours.step / fitting[0].step)  # type: ignore[operator]
    table = format_table({"date": "d", "device": "cpu", "threads": 1, "torch": "t", "size": "tiny", "repeats": 1,
                          "models": {"chain": description}}, rows)  # fmt: skip
    assert CHAIN in table and "peak+input/budget" in table


@pytest.mark.slow  # runs a benchmark: NOTE [ Slow tests ] in tests/conftest.py
def test_main_accepts_the_chain_mode(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(CHAIN_SIZES, "small", TINY_CHAIN)
    path = tmp_path / "bench.json"
    out = io.StringIO()
    assert main(["--model", "chain", "--repeats", "1", "--json", str(path), "--quiet"], stdout=out) == 0
    assert CHAIN in out.getvalue()
    data = json.loads(path.read_text())
    assert data["meta"]["chain"]["budget_fraction"] == 0.5
    assert {r["model"] for r in data["rows"]} == {"chain"}


def test_targets_take_ratios_per_repeat_and_judge_the_median() -> None:
    from benchmarks.targets import check_targets, format_checks

    rows = [
        Result("tiny", NO_REMAT, step_seconds=[1.0, 1.0, 1.0]),
        Result("tiny", TORCH, step_seconds=[4.0, 4.0, 7.0]),
        Result("tiny", "@remat", step_seconds=[1.6, 2.5, 2.2]),  # overheads 0.2, 0.5, 0.2 of torch's
        Result("gpt", NO_REMAT, peak_bytes=900, step_seconds=[1.0, 1.0]),
        Result("gpt", TORCH, peak_bytes=300, step_seconds=[2.0, 2.0]),
        Result("gpt", "@remat", peak_bytes=310, step_seconds=[1.9, 2.1]),
        Result("gpt", "@remat(policy=save_matmuls)", peak_bytes=950, step_seconds=[1.2, 1.2]),
        Result("convnet", NO_REMAT, peak_bytes=900, step_seconds=[1.0]),
        Result("convnet", TORCH, peak_bytes=600, step_seconds=[2.0]),
        Result("convnet", "@remat", peak_bytes=600, step_seconds=[2.0]),
    ]
    checks = {check.what: check for check in check_targets(rows)}
    assert checks["convnet: @remat peak / torch's"].ok
    assert "convnet: @remat peak / no remat's" not in checks  # a target for the GPT stack only
    overhead = checks["@remat per-call overhead / torch.utils.checkpoint's"]
    assert (overhead.median, overhead.low, overhead.high) == pytest.approx((0.2, 0.2, 0.5)) and overhead.ok
    assert not checks["gpt: @remat peak / torch's"].ok  # 310 / 300 > 1.02
    assert not checks["gpt: @remat peak / no remat's"].ok  # 310 / 900 > 1/3
    assert checks["gpt: save_matmuls time overhead / full remat's"].ok  # 0.2 / 1.0
    assert not checks["gpt: save_matmuls peak between full remat and none"].ok  # 950 > 900
    text = format_checks(list(checks.values()))
    assert "✓" in text and "✗" in text and "0.2000 [0.2..0.5]" in text
    assert text.splitlines()[-1].startswith(f"{sum(c.ok for c in checks.values())} of {len(checks)} targets hold")


def test_a_repeat_keeps_the_fastest_of_its_consecutive_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of load on one step does not become the repeat's time (runner.STEPS_PER_REPEAT)."""
    from benchmarks import runner

    times = iter([9.0, 9.0, 5.0, 1.0, 2.0, 7.0, 3.0])  # two warm-ups (NO_REMAT, TORCH), then 2 per repeat...
    monkeypatch.setattr(runner, "_timed_step", lambda model, batch, device: next(times))
    monkeypatch.setattr(runner, "STEPS_PER_REPEAT", 2)
    configs = [c for c in CONFIGS if c.name in (NO_REMAT, TORCH)]
    rows = {r.config: r for r in bench_model("m", GPT(TINY_GPT), CPU, 1, configs, lambda message: None)}
    assert rows[NO_REMAT].step_seconds == [1.0] and rows[TORCH].step_seconds == [2.0]


def _tiny_main(monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[int, str]:
    monkeypatch.setattr(_bench, "bench_startup", lambda progress: [])
    out = io.StringIO()
    status = main(["--model", "tiny", "--repeats", "1", "--quiet", *argv], stdout=out)
    return status, out.getvalue()


def test_a_row_whose_remat_call_raises_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def call(x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("remat: made to fail")

        return call

    configs = [dataclasses.replace(c, wrap_tiny=broken) if c.name == "@remat" else c for c in CONFIGS]
    monkeypatch.setattr(_bench, "CONFIGS", configs)
    status, text = _tiny_main(monkeypatch)
    assert status == 1
    assert "FAILED: RuntimeError: remat: made to fail" in text
    assert "1 row(s) failed:\n  tiny: @remat: RuntimeError: remat: made to fail" in text


def test_a_row_whose_gradients_are_off_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def off(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: fn(x) * 1.01

    configs = [dataclasses.replace(c, wrap_tiny=off) if c.name == "@remat" else c for c in CONFIGS]
    monkeypatch.setattr(_bench, "CONFIGS", configs)
    status, text = _tiny_main(monkeypatch)
    assert status == 1 and "gradients differ from no remat's by" in text


@pytest.mark.slow  # runs a benchmark: NOTE [ Slow tests ] in tests/conftest.py
def test_targets_are_a_developer_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import targets

    def failing(rows: object, summary: object = None) -> list[targets.Check]:
        return [targets.Check("1", "a ratio", 2.0, 2.0, 2.0, "≤ 1", False)]

    monkeypatch.setattr(_bench, "check_targets", failing)
    status, text = _tiny_main(monkeypatch)
    assert status == 0 and "a check for its developers" in text and "noisy" in text
    status, _ = _tiny_main(monkeypatch, "--check")
    assert status == 1


def test_main_accepts_the_compile_mode_and_fails_only_on_real_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import compile_sites

    answers: dict[str, dict[str, Any]] = {}

    def row(kind: str, fraction: float, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return answers.get(kind, {"held": 2**20, "peak": 2**21, "step": 0.1, "grads": True})

    monkeypatch.setattr(compile_sites, "run_row", row)
    answers["remat budget, compile=True"] = {"error": "BudgetError: remat: no choice per block fits"}
    out = io.StringIO()
    assert main(["--model", "compile", "--quiet"], stdout=out) == 0  # a refused budget is an answer
    text = out.getvalue()
    assert "remat(block)+save_matmuls" in text and "compile budget 0.3" in text and "BudgetError" in text
    answers["remat.apply"] = {"held": 1, "peak": 1, "step": 0.1, "grads": False}
    assert main(["--model", "compile", "--quiet"], stdout=io.StringIO()) == 1
    answers["remat.apply"] = {"error": "RuntimeError: inductor failed"}
    assert main(["--model", "compile", "--quiet"], stdout=io.StringIO()) == 1


def test_compile_rows_compare_at_equal_or_lower_peak() -> None:
    from benchmarks.compile_sites import _against_compile

    mib = 2**20
    rows = [
        ("remat budget 0.4", {"peak": 42 * mib, "step": 0.696}),
        ("remat budget 0.7", {"peak": 80 * mib, "step": 0.640}),
        ("remat budget, compile=True 0.3", {"error": "BudgetError: remat: no choice per block fits"}),
        ("compile budget 0.3", {"peak": 30 * mib, "step": 0.700}),
        ("compile budget 0.5", {"peak": 73.9 * mib, "step": 0.693}),
        ("compile budget 0.6", {"peak": 85.9 * mib, "step": 0.622}),
    ]
    lines = _against_compile(rows)
    assert "compile budget 0.3: peak 30.0 MiB, no remat budget row peaks as low" in lines
    # At 73.9 MiB the 80 MiB row is out of reach: the fastest that fits is the 0.4 row, a hair slower.
    assert any(line.startswith("compile budget 0.5") and "remat budget 0.4" in line and "(1.00 of its step)" in line
               for line in lines)
    assert any(line.startswith("compile budget 0.6") and "remat budget 0.7" in line and "(1.03 of its step)" in line
               for line in lines)
    assert lines[-1] == "remat slower at 2 of 2"
