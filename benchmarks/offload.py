"""`python -m benchmarks --model offload --device cuda`: offloading to host memory.

The GPT-like stack (12 blocks, d=768, seq 1024, batch 16) trains one forward+backward step under
bf16 autocast in six configurations, each on its own copy of the same weights and batch: no remat; per-block
remat; `torch.autograd.graph.save_on_cpu(pin_memory=True)`; `remat.offload()` alone; per-block remat with
`offload=True`; per-block remat with `policies.offload(save_matmuls)`. Per row: the device peak of the step
(the allocator's `max_memory_allocated`, minus what was allocated before it: parameters and gradients), the
host bytes of the saved copies at their peak, the step time (median of interleaved repeats) and the largest
gradient difference from no remat. Offload needs an accelerator: on CPU the rows are skipped (there is
nowhere cheaper than host memory to put CPU tensors).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from remat._api import remat
from remat._core.policies import offload as offload_policy
from remat._core.policies import save_matmuls
from remat._core.units import format_bytes
from remat._demo import GPT, GPTConfig, human_count, parameter_count
from remat._engine.offload import Offload
from remat._engine.transfer import host_bytes
from remat._measure.track import track

from .runner import GRAD_BOUND, note

__all__ = ["NEEDS_ACCELERATOR", "OFFLOAD_SIZE", "bench_offload"]

OFFLOAD_SIZE = GPTConfig(blocks=12, d=768, heads=12, seq=1024, batch=16)
NEEDS_ACCELERATOR = (
    "offload needs an accelerator (run with --device cuda): on CPU there is nowhere cheaper to put saved "
    "tensors, so its rows were skipped"
)
SEED = 1234

Context = Callable[[], AbstractContextManager[Any]]


def _rows(offload: Offload) -> list[tuple[str, Callable[[GPT], Context]]]:
    """(name, prepare): prepare changes a copy of the model in place and returns the forward's context."""

    def plain(model: GPT) -> Context:
        return contextlib.nullcontext

    def blocks(model: GPT) -> Context:
        for block in model.blocks:
            remat(block)
        return contextlib.nullcontext

    def save_on_cpu(model: GPT) -> Context:
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)

    def offload_alone(model: GPT) -> Context:
        return lambda: offload

    def blocks_offload(model: GPT) -> Context:
        for block in model.blocks:
            remat(offload=offload)(block)
        return contextlib.nullcontext

    def matmuls_offload(model: GPT) -> Context:
        for block in model.blocks:
            remat(policy=offload_policy(save_matmuls))(block)
        return contextlib.nullcontext

    return [
        ("no remat", plain),
        ("per-block remat", blocks),
        ("save_on_cpu(pin_memory=True)", save_on_cpu),
        ("remat.offload()", offload_alone),
        ("per-block remat, offload=True", blocks_offload),
        ("per-block offload(save_matmuls)", matmuls_offload),
    ]


def _step(model: GPT, batch: Sequence[torch.Tensor], context: Context, device: torch.device) -> torch.Tensor:
    with context(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type != "cpu"):
        loss = model.loss(*batch)
    torch.autograd.backward(loss)
    return loss.detach()


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def _measure(
    model: GPT, batch: Sequence[torch.Tensor], context: Context, device: torch.device
) -> tuple[int, int, list[torch.Tensor]]:
    """One step: device peak beyond what was allocated before it, host bytes of saved copies, gradients."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(SEED)
    _synchronize(device)
    host_bytes(reset_peak=True)
    if device.type == "cpu":  # for tests: no allocator statistics, count live tensors instead
        with track() as t:
            _step(model, batch, context, device)
        peak, host = t.peak_bytes, host_bytes()[1]
    else:
        module = torch.get_device_module(device.type)
        module.reset_peak_memory_stats(device)
        before = module.memory_allocated(device)
        with track() as t:  # torch's save_on_cpu copies are seen by the tracker, ours by `host_bytes`
            _step(model, batch, context, device)
        _synchronize(device)
        peak = module.max_memory_allocated(device) - before
        host = max(host_bytes()[1], t.peak("cpu"))
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return peak, host, grads


def bench_offload(
    device: torch.device,
    repeats: int,
    progress: Callable[[str], None],
    *,
    config: GPTConfig = OFFLOAD_SIZE,
    offload: Offload | None = None,
) -> tuple[str, list[dict[str, Any]]]:
    """Run the offload rows; return the model's description and one dict per row.

    Each row has `config`, `peak_bytes` (device), `host_bytes`, `step_seconds` (every repeat), `grad_diff` and
    `note`. On CPU nothing runs unless `offload` copies CPU tensors (`remat.offload(include_cpu=True)`, for
    tests): the description then says why.

    Args:
        device: where to run.
        repeats: timed steps per row, interleaved across rows.
        progress: called with a status message as the run goes.
        config: the size of the GPT-like stack.
        offload: the settings of the offloading rows (default `remat.offload()`).
    """
    offload = offload or Offload()
    if device.type == "cpu" and not offload.include_cpu:
        return NEEDS_ACCELERATOR, []
    base = GPT(config).to(device).train()
    if device.type == "cpu":
        how = "float32, the CPU path of include_cpu (for tests; remat.track counts the peak)"
    else:
        how = "bf16 autocast; peak: max_memory_allocated beyond parameters and gradients"
    description = (
        f"GPT-like stack, {base.describe()} ({human_count(parameter_count(base))} parameters), {how}; "
        "host: bytes of saved copies at their peak"
    )
    batch = base.sample(device, seed=SEED)
    rows: list[dict[str, Any]] = []
    running: list[tuple[dict[str, Any], GPT, Context]] = []
    for name, prepare in _rows(offload):
        row: dict[str, Any] = {"config": name, "peak_bytes": None, "host_bytes": None, "step_seconds": [],
                               "grad_diff": None, "note": "", "error": ""}
        rows.append(row)
        model = copy.deepcopy(base)
        try:
            context = prepare(model)
            torch.manual_seed(SEED)
            _step(model, batch, context, device)  # warm-up
        except Exception as error:  # a row that cannot run fails with why; the others go on
            row["error"] = note(error)
            row["note"] = f"FAILED: {row['error']}"
            continue
        running.append((row, model, context))
    reference: list[torch.Tensor] | None = None
    for row, model, context in running:
        progress(f"offload: memory of {row['config']}")
        row["peak_bytes"], row["host_bytes"], grads = _measure(model, batch, context, device)
        if reference is None:
            reference = grads
        row["grad_diff"] = diff = max(
            (float((g.float() - r.float()).abs().max()) for g, r in zip(grads, reference, strict=True) if g.numel()),
            default=0.0,
        )
        bound = GRAD_BOUND * max([1.0, *(float(r.float().abs().max()) for r in reference if r.numel())])
        if not diff <= bound:
            row["error"] = f"gradients differ from no remat's by {diff:.1e} (bound {bound:.1e})"
            row["note"] = f"FAILED: {row['error']}"
    for r in range(repeats):
        for row, model, context in running:
            progress(f"offload: repeat {r + 1}/{repeats}, {row['config']}")
            for p in model.parameters():
                p.grad = None
            torch.manual_seed(SEED + r)
            _synchronize(device)
            start = time.perf_counter()
            _step(model, batch, context, device)
            _synchronize(device)
            row["step_seconds"].append(time.perf_counter() - start)
    for row in rows:
        if row["host_bytes"]:
            row["note"] = (row["note"] + f" host {format_bytes(row['host_bytes'])}").strip()
    return description, rows
