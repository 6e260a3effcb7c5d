"""`python -m benchmarks --model head` (or `python -m benchmarks.head`): the head and the loss in chunks.

A GPT-2 of 4 layers (d=128, 4 heads) with the real vocabulary (50,257), batch 4 x seq 512, trains one step in three
configurations, each on its own copy of the same weights and batch: no remat, `remat.apply(model)` (full remat of
every block) and `remat.apply(model, head=True)` (the same, and the loss through `remat.linear_cross_entropy`). Per
row: the step's peak as `remat.track()` counts it above what was live before the step, with the gradients that
backward allocates (they start as None, as after a default loop's `optimizer.zero_grad()`: the quantity a budget
bounds), measured on the first step; the step time (the median of `--repeats` steps taken in rounds
across the rows, so that the machine's drift affects them alike); and whether the gradients equal no remat's, on a
float64 copy of the model (`torch.testing.assert_close` at float64's tolerances; the model's own loss upcasts to
float32, so no remat's loss is taken in float64 from its logits, as `linear_cross_entropy` keeps float64).

Targets (issue 45): full remat + head peaks at most 0.5x full remat's peak, its step takes at most 1.1x full remat's,
and its gradients equal no remat's.

`--sweep` times the head and the loss alone (`linear_cross_entropy`'s forward and backward on the same 2,048 tokens
of width 128 and the 50,257 classes) at chunk sizes from 4 MiB of logits to all of them in one chunk, against the
plain `F.cross_entropy(F.linear(...))`, with each one's peak: what `chunks=None`'s 64 MiB is defended with.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat._core.units import format_bytes

__all__ = ["CONFIGS", "PEAK_TARGET", "STEP_TARGET", "main", "measure", "sweep"]

VOCAB, LAYERS, D, HEADS, BATCH, SEQ = 50257, 4, 128, 4, 4, 512
PEAK_TARGET = 0.5
"""Full remat + head peaks at most this fraction of full remat's peak."""
STEP_TARGET = 1.1
"""Full remat + head's step takes at most this multiple of full remat's."""

CONFIGS: dict[str, Callable[[nn.Module], object]] = {
    "no remat": lambda model: None,
    "remat.apply(model)": lambda model: remat.apply(model),
    "remat.apply(model, head=True)": lambda model: remat.apply(model, head=True),
}


def _model(seq: int) -> nn.Module:
    hf: Any = importlib.import_module("transformers")  # the `hf` extra
    config = hf.GPT2Config(
        vocab_size=VOCAB, n_embd=D, n_layer=LAYERS, n_head=HEADS, n_positions=seq, bos_token_id=0, eos_token_id=0,
    )
    model: nn.Module = hf.GPT2LMHeadModel(config).train()
    return model


def _batch(batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    for parameter in model.parameters():
        parameter.grad = None  # backward allocates them, as after `optimizer.zero_grad()`
    model(**batch).loss.backward()


def _float64_grads(base: nn.Module, configure: Callable[[nn.Module], object], batch: dict[str, torch.Tensor],
                   own_loss: bool) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(base).double()
    configure(model)
    for parameter in model.parameters():
        parameter.grad = None
    torch.manual_seed(1)
    if own_loss:
        model(**batch).loss.backward()
    else:  # the model's loss, in float64: its own `ForCausalLMLoss` upcasts the logits to float32
        logits = model(input_ids=batch["input_ids"]).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
        torch.autograd.backward(loss)
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def measure(repeats: int = 5, batch: int = BATCH, seq: int = SEQ) -> dict[str, Any]:
    """Peak, step times and gradient check per configuration (see the module's docstring)."""
    torch.manual_seed(0)
    base = _model(seq)
    inputs = _batch(batch, seq)
    rows: dict[str, dict[str, Any]] = {}
    for label, configure in CONFIGS.items():
        model = copy.deepcopy(base)
        configure(model)
        torch.manual_seed(1)
        with remat.track() as tracker:
            _step(model, inputs)
        rows[label] = {"model": model, "peak_bytes": tracker.peak_bytes, "seconds": []}
    for r in range(repeats):
        for row in rows.values():
            torch.manual_seed(2 + r)
            start = time.perf_counter()
            _step(row["model"], inputs)
            row["seconds"].append(time.perf_counter() - start)
    reference = _float64_grads(base, CONFIGS["no remat"], inputs, own_loss=False)
    for label, configure in CONFIGS.items():
        row = rows[label]
        del row["model"]
        row["step_seconds"] = statistics.median(row.pop("seconds"))
        if label == "no remat":
            continue
        grads = _float64_grads(base, configure, inputs, own_loss=True)
        try:
            assert grads.keys() == reference.keys()
            for name, grad in reference.items():
                torch.testing.assert_close(grads[name], grad)
            row["grads_equal"] = True
        except AssertionError:
            row["grads_equal"] = False
    return {"batch": batch, "seq": seq, "threads": torch.get_num_threads(), "rows": rows}


def format_result(result: dict[str, Any]) -> str:
    rows = result["rows"]
    none, full, head = (rows[label] for label in CONFIGS)
    lines = [
        f"GPT-2, {LAYERS} layers, d={D}, vocabulary {VOCAB:,}, batch {result['batch']} x seq {result['seq']}, "
        f"float32, CPU, {result['threads']} thread(s); peak: remat.track above the step's start, gradients "
        "allocated by backward; step: median of interleaved steps; gradients: float64, against no remat",
        f"{'configuration':32s} {'peak':>11s} {'vs none':>8s} {'step':>9s} {'vs full':>8s}  gradients equal",
    ]
    for label, row in rows.items():
        equal = "(the reference)" if "grads_equal" not in row else "yes" if row["grads_equal"] else "NO"
        lines.append(
            f"{label:32s} {format_bytes(row['peak_bytes']):>11s} {row['peak_bytes'] / none['peak_bytes']:7.2f}x "
            f"{row['step_seconds'] * 1e3:7.0f}ms {row['step_seconds'] / full['step_seconds']:7.2f}x  {equal}"
        )
    peak = head["peak_bytes"] / full["peak_bytes"]
    step = head["step_seconds"] / full["step_seconds"]
    lines += [
        "",
        f"target: head=True peaks <= {PEAK_TARGET}x full remat's: {peak:.2f}x {_verdict(peak <= PEAK_TARGET)}",
        f"target: head=True steps <= {STEP_TARGET}x full remat's: {step:.2f}x {_verdict(step <= STEP_TARGET)}",
        f"target: gradients equal no remat's (float64): {'ok' if head.get('grads_equal') else 'MISSED'}",
    ]
    return "\n".join(lines)


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def targets_hold(result: dict[str, Any]) -> bool:
    rows = result["rows"]
    _, full, head = (rows[label] for label in CONFIGS)
    return bool(head["peak_bytes"] <= PEAK_TARGET * full["peak_bytes"]
                and head["step_seconds"] <= STEP_TARGET * full["step_seconds"] and head.get("grads_equal"))


SWEEP_MIB = (4, 16, 64, 256)


def sweep(repeats: int = 3, tokens: int = BATCH * SEQ) -> list[tuple[str, int, float]]:
    """(row, peak bytes, median seconds) of the head and the loss alone, per chunk size (see the docstring)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, D, generator=generator)
    weight = torch.randn(VOCAB, D, generator=generator) * 0.02
    labels = torch.randint(0, VOCAB, (tokens,), generator=generator)
    full = tokens * VOCAB * 4

    def plain(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, w), labels)

    def chunked(mib: int | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        count = 1 if mib is None else max(1, -(-full // (mib * 2**20)))
        return lambda h, w: remat.linear_cross_entropy(h, w, labels, chunks=count)

    rows: list[tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = [
        ("F.cross_entropy(F.linear(...))", plain),
        *((f"chunks of {mib} MiB" + (" (chunks=None)" if mib == 64 else ""), chunked(mib)) for mib in SWEEP_MIB),
        (f"one chunk ({full / 2**20:.0f} MiB)", chunked(None)),
    ]
    peaks: dict[str, int] = {}
    seconds: dict[str, list[float]] = {label: [] for label, _ in rows}

    def step(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        start = time.perf_counter()
        torch.autograd.backward(fn(h, w))
        return time.perf_counter() - start

    for label, fn in rows:
        with remat.track() as tracker:
            step(fn)
        peaks[label] = tracker.peak_bytes
    for _ in range(repeats):
        for label, fn in rows:
            seconds[label].append(step(fn))
    return [(label, peaks[label], statistics.median(seconds[label])) for label, _ in rows]


def format_sweep(rows: list[tuple[str, int, float]]) -> str:
    lines = [f"the head and the loss alone: {BATCH * SEQ:,} tokens, width {D}, {VOCAB:,} classes, float32, CPU, "
             f"{torch.get_num_threads()} thread(s); median of interleaved steps",
             f"{'configuration':36s} {'peak':>11s} {'step':>9s} {'vs plain':>9s}"]
    plain = rows[0][2]
    for label, peak, seconds in rows:
        lines.append(f"{label:36s} {format_bytes(peak):>11s} {seconds * 1e3:7.0f}ms {seconds / plain:8.2f}x")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Print the table; exit status 1 where `--check` is given and a target does not hold."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.head", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per configuration (median shown)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--check", action="store_true", help="exit with status 1 when a target does not hold")
    parser.add_argument("--sweep", action="store_true", help="the head and the loss alone, per chunk size")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sweep:
        print(format_sweep(sweep(args.repeats, args.batch * args.seq)), file=out or sys.stdout)
        return 0
    result = measure(args.repeats, args.batch, args.seq)
    print(format_result(result), file=out or sys.stdout)
    return 1 if args.check and not targets_hold(result) else 0


if __name__ == "__main__":
    raise SystemExit(main())
