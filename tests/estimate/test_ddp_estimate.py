"""Per-rank estimates under DDP (`remat.estimate(..., shard="ddp")`) against real 2-process gloo runs.

The baseline is independent of the estimator: `examples/ddp.py` trains each configuration for three AdamW
steps under `DistributedDataParallel` on two processes, counting the rank's live bytes with `remat.track()`
from before DDP allocates its gradient buckets.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port
from torch import nn

import remat
from remat._demo import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


def _lines(stdout: str) -> dict[tuple[str, str, str], tuple[float, float]]:
    """(rank, config, views) -> (estimated, measured) MiB, from the example's output."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("rank "):
            head, numbers = line.split(": estimated peak ")
            _, rank, _, config, views = head.split()
            estimated = float(numbers.split()[0])
            measured = float(numbers.split("measured ")[1].split()[0])
            out[(rank, config, views)] = (estimated, measured)
    return out


@pytest.mark.slow  # two real gloo ranks: NOTE [ Slow tests ] in tests/conftest.py
def test_example_estimates_within_5_percent_of_two_real_ranks() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), str(ROOT / "examples" / "ddp.py"), "--views"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = _lines(done.stdout)
    assert len(found) == 8, done.stdout  # 2 ranks x (none, full) x (gradient_as_bucket_view False, True)
    for key, (estimated, measured) in found.items():
        assert measured == pytest.approx(estimated, rel=0.05), (key, done.stdout)
    for rank in ("0/2", "1/2"):
        for views in ("gradient_as_bucket_view=False", "gradient_as_bucket_view=True"):
            assert found[(rank, "full", views)][1] < found[(rank, "none", views)][1], "remat was active"
    # The buckets are counted: without them the estimate falls short of the run by the parameters' bytes.
    example = runpy.run_path(str(ROOT / "examples" / "ddp.py"))  # its model, not its main
    cfg = example["CFG"]
    idx = torch.zeros(cfg.batch, cfg.seq, dtype=torch.long)
    model = example["build"]("none", meta=True)
    plain = remat.estimate(model, idx, optimizer="adamw", configs=("none",))["none"].peak_bytes / MiB
    params = sum(p.numel() * 4 for p in model.parameters()) / MiB
    measured = found[("0/2", "none", "gradient_as_bucket_view=False")][1]
    assert measured == pytest.approx(plain + params, rel=0.02) and measured > 1.1 * plain


CFG = GPTConfig(blocks=2, d=32, heads=2, seq=16, batch=2, vocab=64, dropout=0.0)


def test_buckets_are_the_trainable_parameters_once() -> None:
    with torch.device("meta"):
        model = GPT(CFG)
    idx = torch.zeros(CFG.batch, CFG.seq, dtype=torch.long)
    plain = remat.estimate(model, idx, optimizer="sgd", configs=("none",))["none"]
    ddp = remat.estimate(model, idx, optimizer="sgd", configs=("none",), world_size=8, shard="ddp")["none"]
    trainable = sum(p.numel() * 4 for p in model.parameters())
    assert ddp.peak_bytes == plain.peak_bytes + trainable
    assert (ddp.params_bytes, ddp.grads_bytes, ddp.optimizer_bytes) == (
        plain.params_bytes, plain.grads_bytes, plain.optimizer_bytes), "nothing is sharded under DDP"
    model.blocks[0].requires_grad_(False)  # frozen parameters have no bucket
    frozen = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    less = remat.estimate(model, idx, optimizer="sgd", configs=("none",), shard="ddp")["none"]
    plain_less = remat.estimate(model, idx, optimizer="sgd", configs=("none",))["none"]
    assert less.peak_bytes == plain_less.peak_bytes + trainable - frozen


def test_bad_shard_settings_are_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="remat: estimate's `shard` must be None, 'fsdp2' or 'ddp'"):
        remat.estimate(model, torch.randn(2, 4), configs=("none",), world_size=2, shard="zero3")
    with pytest.raises(ValueError, match="positive int"):
        remat.estimate(model, torch.randn(2, 4), configs=("none",), world_size=0, shard="ddp")


def test_wrapped_model_with_fsdp2_shard_is_refused() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4)), gradient_as_bucket_view=True)
        with pytest.raises(ValueError, match="DistributedDataParallel model with shard='fsdp2'"):
            remat.estimate(ddp, torch.randn(2, 4), configs=("none",), shard="fsdp2")
        params = {name: (p, p.detach().clone()) for name, p in ddp.named_parameters()}
        report = remat.estimate(ddp, torch.randn(2, 4), configs=("none",))  # with a live process group
        assert report.model == "DistributedDataParallel"
        assert report["none"].grads_bytes == 20 * 4, "gradients: the parameters' bytes"
        for name, p in ddp.named_parameters():  # left as it was: same tensors, values, no grads, no hooks
            assert p is params[name][0] and p.grad is None and not p._post_accumulate_grad_hooks
            torch.testing.assert_close(p, params[name][1])
        # DDP still trains. Without a collective: gloo's worker thread frees an allreduce's work after it completes,
        # and if the group dies with it (the test returning) while that thread waits for the GIL, torch deadlocks
        # (seen once in the full suite: ~ProcessGroupGloo under the Reducer's dealloc, the worker in ~AsyncWork).
        with ddp.no_sync():
            ddp(torch.randn(2, 4)).sum().backward()
        assert all(p.grad is not None for p in ddp.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # starts a subprocess: NOTE [ Slow tests ] in tests/conftest.py
def test_cli_counts_the_buckets() -> None:
    pytest.importorskip("transformers")
    import io

    from remat._estimate_cli import estimate_main as main

    peaks: dict[str, float] = {}
    params = 0.0
    for flags in ([], ["--world-size", "4", "--shard", "ddp"]):
        text = io.StringIO()
        assert main(["--hf", "llama", "--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "16",
                     "--optimizer", "sgd", *flags], text) == 0
        row = next(line for line in text.getvalue().splitlines() if line.startswith("none")).split()
        numbers = [float(cell) for cell in row if cell.replace(".", "", 1).isdigit()]  # MiB; "peaks in" last
        params, peaks[" ".join(flags)] = numbers[0], numbers[-1]
    assert peaks["--world-size 4 --shard ddp"] == pytest.approx(peaks[""] + params, abs=0.02), peaks
