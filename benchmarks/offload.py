"""`python -m benchmarks --model offload --device cuda`: offloading to host memory.

The GPT-like stack (12 blocks, d=768, seq 1024, batch 16) trains one forward+backward step under
bf16 autocast in seven configurations, each on its own copy of the same weights and batch: no remat; per-block
remat; `torch.autograd.graph.save_on_cpu(pin_memory=True)`; `remat.offload()` alone; per-block remat with
`offload=True`, also with 256 MiB in flight instead of 64 (`WIDER`); per-block remat with
`policies.offload(save_matmuls)`. Per row: the device peak of the step
(the allocator's `max_memory_allocated`, minus what was allocated before it: parameters and gradients), the
host bytes of the saved copies at their peak, the step time (median of interleaved repeats), the largest
gradient difference from no remat, and the copies between device and host in the step (NOTE [ What crosses ] in
remat/_engine/transfer.py): how many and how many bytes each way, how many were not brought back because their
device memory was still held, how many touched pageable host memory. Then, unless `profile=False`, one more step
per row under `torch.profiler` (`profile_rows`): the device's copies by kind (device->pinned, device->pageable,
...) with their device time, the host's time in the calls that block it (synchronizations, pageable
`cudaMemcpyAsync`, pinned allocations), and where the step spent its time, so that a regression shows in one run.
Offload needs an accelerator: on CPU the rows are skipped (there is nowhere cheaper than host memory to put CPU
tensors).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from remat._api import remat
from remat._core.policies import offload as offload_policy
from remat._core.policies import save_matmuls
from remat._core.units import format_bytes
from remat._demo import GPT, GPTConfig, human_count, parameter_count
from remat._engine import transfer as _transfer
from remat._engine.offload import Offload
from remat._engine.transfer import offloaded_bytes, traffic
from remat._measure.track import track

from .runner import GRAD_BOUND, note

__all__ = ["NEEDS_ACCELERATOR", "OFFLOAD_SIZE", "SAVE_ON_CPU", "bench_offload", "format_offload", "profile_step"]

OFFLOAD_SIZE = GPTConfig(blocks=12, d=768, heads=12, seq=1024, batch=16)
NEEDS_ACCELERATOR = (
    "offload needs an accelerator (run with --device cuda): on CPU there is nowhere cheaper to put saved "
    "tensors, so its rows were skipped"
)
SAVE_ON_CPU = "save_on_cpu(pin_memory=True)"
# The row that lets more device memory wait for its copy to host than offload does (`_PENDING_BYTES`, 64 MiB): how
# much of per-block offload's step is forward waiting on the host link, measured against the memory it costs.
WIDER = 256 << 20
SEED = 1234

Context = Callable[[], AbstractContextManager[Any]]


class _Counts:
    """Copies that torch's `save_on_cpu` makes, counted in its hooks (ours count themselves: `traffic()`)."""

    def __init__(self) -> None:
        self.values = dict.fromkeys(("out", "out_bytes", "back", "back_bytes"), 0)

    def hooks(self) -> AbstractContextManager[Any]:
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=True)
        pack, unpack, values = hooks.pack_hook, hooks.unpack_hook, self.values

        def counted_pack(tensor: torch.Tensor) -> Any:
            values["out"] += 1
            values["out_bytes"] += tensor.numel() * tensor.element_size()
            return pack(tensor)

        def counted_unpack(packed: Any) -> torch.Tensor:
            values["back"] += 1
            values["back_bytes"] += packed[1].numel() * packed[1].element_size()
            return unpack(packed)

        hooks.pack_hook, hooks.unpack_hook = counted_pack, counted_unpack
        return hooks


def _rows(offload: Offload, counts: _Counts) -> list[tuple[str, Callable[[GPT], Context]]]:
    """(name, prepare): prepare changes a copy of the model in place and returns the forward's context."""

    def plain(model: GPT) -> Context:
        return contextlib.nullcontext

    def blocks(model: GPT) -> Context:
        for block in model.blocks:
            remat(block)
        return contextlib.nullcontext

    def save_on_cpu(model: GPT) -> Context:
        return counts.hooks

    def offload_alone(model: GPT) -> Context:
        return lambda: offload

    def blocks_offload(model: GPT) -> Context:
        for block in model.blocks:
            remat(offload=offload)(block)
        return contextlib.nullcontext

    def blocks_offload_wider(model: GPT) -> Context:
        blocks_offload(model)
        return _in_flight(WIDER)

    def matmuls_offload(model: GPT) -> Context:
        for block in model.blocks:
            remat(policy=offload_policy(save_matmuls))(block)
        return contextlib.nullcontext

    return [
        ("no remat", plain),
        ("per-block remat", blocks),
        (SAVE_ON_CPU, save_on_cpu),
        ("remat.offload()", offload_alone),
        ("per-block remat, offload=True", blocks_offload),
        (f"per-block remat, offload=True, {WIDER >> 20} MiB in flight", blocks_offload_wider),
        ("per-block offload(save_matmuls)", matmuls_offload),
    ]


def _in_flight(limit: int) -> Context:
    @contextlib.contextmanager
    def context() -> Iterator[None]:
        before, _transfer._PENDING_BYTES = _transfer._PENDING_BYTES, limit
        try:
            yield
        finally:
            _transfer._PENDING_BYTES = before

    return context


def _step(model: GPT, batch: Sequence[torch.Tensor], context: Context, device: torch.device) -> torch.Tensor:
    with context(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type != "cpu"):
        loss = model.loss(*batch)
    torch.autograd.backward(loss)
    return loss.detach()


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def _measure(
    model: GPT, batch: Sequence[torch.Tensor], context: Context, device: torch.device, counts: _Counts
) -> tuple[int, int, dict[str, int | None], list[torch.Tensor]]:
    """One step: device peak beyond what was allocated before it, host bytes of saved copies, the copies between
    device and host, gradients."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(SEED)
    _synchronize(device)
    offloaded_bytes(reset_peak=True)
    traffic(reset=True)
    theirs = dict(counts.values)
    if device.type == "cpu":  # for tests: no allocator statistics, count live tensors instead
        with track() as t:
            _step(model, batch, context, device)
        peak, host = t.peak_bytes, offloaded_bytes()[1]
    else:
        module = torch.get_device_module(device.type)
        module.reset_peak_memory_stats(device)
        before = module.memory_allocated(device)
        with track() as t:  # torch's save_on_cpu copies are seen by the tracker, ours by `offloaded_bytes`
            _step(model, batch, context, device)
        _synchronize(device)
        peak = module.max_memory_allocated(device) - before
        host = max(offloaded_bytes()[1], t.peak("cpu"))
    moved: dict[str, int | None] = dict(traffic()._asdict())
    if counts.values["out"] > theirs["out"]:  # torch's save_on_cpu: counted in its hooks; pageable copies are
        # not (its pack hook asks for pinned memory; the profile shows what every row's copies touched)
        moved = {**{key: counts.values[key] - theirs[key] for key in theirs}, "kept": 0, "kept_bytes": 0,
                 "pageable": None}  # fmt: skip
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return peak, host, moved, grads


def bench_offload(
    device: torch.device,
    repeats: int,
    progress: Callable[[str], None],
    *,
    config: GPTConfig = OFFLOAD_SIZE,
    offload: Offload | None = None,
    profile: bool = True,
    trace: str | None = None,
) -> tuple[str, list[dict[str, Any]]]:
    """Run the offload rows; return the model's description and one dict per row.

    Each row has `config`, `peak_bytes` (device), `host_bytes`, `step_seconds` (every repeat), `grad_diff`,
    `traffic` (the step's copies between device and host: `out`, `out_bytes`, `back`, `back_bytes`, `kept`,
    `kept_bytes`, `pageable`; all zero for rows that copy nothing), `profile` (see `profile_step`; None when not
    profiled) and `note`. On CPU nothing runs unless `offload` copies CPU tensors (`remat.offload(include_cpu=True)`,
    for tests): the description then says why.

    Args:
        device: where to run.
        repeats: timed steps per row, interleaved across rows.
        progress: called with a status message as the run goes.
        config: the size of the GPT-like stack.
        offload: the settings of the offloading rows (default `remat.offload()`).
        profile: profile one more step per row after the timed ones (`profile_step`).
        trace: a folder to write each profiled step's Chrome trace to (`offload-<row>.json`), and on an
            accelerator its memory timeline (`offload-<row>-memory.json.gz`: bytes live by kind over the step).
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
        "host: bytes of saved copies at their peak; copies: to host / back / not brought back (device memory "
        "still held) / with pageable memory, in the measured step"
    )
    batch = base.sample(device, seed=SEED)
    counts = _Counts()
    rows: list[dict[str, Any]] = []
    running: list[tuple[dict[str, Any], GPT, Context]] = []
    for name, prepare in _rows(offload, counts):
        row: dict[str, Any] = {"config": name, "peak_bytes": None, "host_bytes": None, "step_seconds": [],
                               "grad_diff": None, "traffic": None, "profile": None, "note": "", "error": ""}
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
        row["peak_bytes"], row["host_bytes"], row["traffic"], grads = _measure(model, batch, context, device, counts)
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
    if profile:
        for row, model, context in running:
            progress(f"offload: profile of {row['config']}")
            path = None if trace is None else os.path.join(trace, f"offload-{_slug(row['config'])}.json")
            row["profile"] = profile_step(functools.partial(_step, model, batch, context, device), device, path)
    for row in rows:
        moved = row["traffic"]
        if row["host_bytes"]:
            row["note"] = (row["note"] + f" host {format_bytes(row['host_bytes'])}").strip()
        if moved and moved["out"]:
            pageable = "-" if moved["pageable"] is None else moved["pageable"]
            row["note"] += f"; copies {moved['out']}/{moved['back']}/{moved['kept']}/{pageable}"
    return description, rows


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# -- one step under torch.profiler --------------------------------------------------------------------------------

# The host calls that block it, or that a step in its steady state should not make (CUDA's runtime names; other
# accelerators' profiles show their own, and these read zero there).
BLOCKING = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaHostAlloc",
            "cudaMallocHost", "cudaFreeHost", "cudaMalloc", "cudaFree")  # fmt: skip
STEP = "benchmarks.offload step"


def profile_step(step: Callable[[], object], device: torch.device, trace: str | None = None) -> dict[str, Any]:
    """Run `step` once under `torch.profiler` and summarize what a regression of offload would show.

    Returns a dict: `seconds` (the step, under the profiler), `memcpy` ({kind: [count, device ms]} for the
    device's copies: "DtoH (Device -> Pinned)", "DtoH (Device -> Pageable)", "HtoD (Pinned -> Device)", ...),
    `blocking` ({runtime call: [count, host ms]} for the calls in `BLOCKING` made during the step, and
    `cudaMemcpyAsync`, which blocks the host for pageable memory), `device_top` and `host_top` (the five ops
    with the most self device time, and the five aten ops with the most host time: [name, ms]).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    activity = {"cuda": "CUDA", "xpu": "XPU"}.get(device.type)
    if activity is not None and hasattr(ProfilerActivity, activity):
        activities.append(getattr(ProfilerActivity, activity))
    timeline = trace is not None and device.type != "cpu"  # the memory timeline: what is live when, by kind
    _synchronize(device)
    with profile(activities=activities, profile_memory=timeline, record_shapes=timeline, with_stack=timeline) as prof:
        start = time.perf_counter()
        with record_function(STEP):
            step()
            _synchronize(device)  # inside the step's range: the one synchronization the harness makes
        seconds = time.perf_counter() - start
    if trace is not None:
        os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
        prof.export_chrome_trace(trace)
        if timeline:  # issue 55: where a row's peak comes from (activations, copies in flight, brought back ahead)
            index = device.index if device.index is not None else torch.get_device_module(device.type).current_device()
            prof.export_memory_timeline(trace.removesuffix(".json") + "-memory.json.gz", f"{device.type}:{index}")
    events = prof.events()
    ranges = [e.time_range for e in events if e.name == STEP]
    low, high = (ranges[0].start, ranges[0].end) if ranges else (float("-inf"), float("inf"))
    memcpy: dict[str, list[float]] = {}
    blocking: dict[str, list[float]] = {}
    device_time: dict[str, float] = {}
    host_time: dict[str, float] = {}
    for event in events:
        name = event.name
        if name.startswith("Memcpy"):
            kind = memcpy.setdefault(name.removeprefix("Memcpy").strip(), [0, 0.0])
            kind[0] += 1
            kind[1] += _device_us(event) / 1e3
        elif name in BLOCKING or name == "cudaMemcpyAsync":
            if low <= event.time_range.start <= high:
                call = blocking.setdefault(name, [0, 0.0])
                call[0] += 1
                call[1] += event.cpu_time_total / 1e3
        elif _device_us(event):
            device_time[name] = device_time.get(name, 0.0) + _device_us(event) / 1e3
        if name.startswith("aten::"):
            host_time[name] = host_time.get(name, 0.0) + event.cpu_time_total / 1e3
    return {
        "seconds": seconds,
        "memcpy": memcpy,
        "blocking": blocking,
        "device_top": sorted(device_time.items(), key=lambda item: -item[1])[:5],
        "host_top": sorted(host_time.items(), key=lambda item: -item[1])[:5],
    }


def _device_us(event: Any) -> float:
    """An event's own device time in microseconds (a copy's or a kernel's duration on the device)."""
    if getattr(getattr(event, "device_type", None), "name", "CPU") == "CPU":
        return 0.0
    try:
        return float(event.device_time_total or 0.0)
    except (AssertionError, AttributeError):  # a device type this torch's profiler does not time
        return 0.0


def format_offload(rows: Sequence[dict[str, Any]]) -> str:
    """The copies between device and host of each row, and its profile: the section printed after the table."""
    lines = ["Offload: copies between device and host in one step, and one step per row under torch.profiler"]
    for row in rows:
        moved, profiled = row.get("traffic"), row.get("profile")
        if not moved and not profiled:
            continue
        lines.append(f"  {row['config']}")
        if moved and moved["out"]:
            pageable = "not counted" if moved["pageable"] is None else moved["pageable"]
            lines.append(
                f"    copies: to host {moved['out']} ({format_bytes(moved['out_bytes'])}), back {moved['back']} "
                f"({format_bytes(moved['back_bytes'])}), not brought back {moved['kept']} "
                f"({format_bytes(moved['kept_bytes'])}), with pageable memory {pageable}"
            )
        if profiled:
            copies = ", ".join(f"{kind} {n} ({ms:.1f} ms)" for kind, (n, ms) in sorted(profiled["memcpy"].items()))
            blocked = ", ".join(f"{call} {n} ({ms:.1f} ms)" for call, (n, ms) in sorted(profiled["blocking"].items()))
            lines += [
                f"    profiled step {profiled['seconds'] * 1e3:.1f} ms; device copies: {copies or 'none'}",
                f"    host calls (a cudaDeviceSynchronize ends each profiled step): {blocked or 'none'}",
                "    most device time: " + (", ".join(f"{n} {ms:.1f} ms" for n, ms in profiled["device_top"]) or "-"),
                "    most host time: " + (", ".join(f"{n} {ms:.1f} ms" for n, ms in profiled["host_top"]) or "-"),
            ]
    return "\n".join(lines) if len(lines) > 1 else ""
