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
of width 128 and the 50,257 classes, or `--batch`, `--seq`, `--width`, `--vocabulary`) at chunks of 32 to 2,048 rows
(tokens) and at the rows `chunks=None` picks, against the plain `F.cross_entropy(F.linear(...).float())`, with each
one's peak as `remat.track` counts it: what NOTE [ The head in chunks ]'s rows per chunk are defended with.
`--device cuda --autocast` runs it on a GPU under bf16 autocast; `--against REV` also times each chunk count through
`linear_cross_entropy` as it was at git revision REV, interleaved in the same run.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat._core.units import format_bytes
from remat._sites.cross_entropy import chunk_count

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


SWEEP_ROWS = (32, 64, 128, 256, 512, 1024, 2048)
"""Rows (tokens) per chunk that `--sweep` times, where there are that many tokens."""


def _before(rev: str) -> Callable[..., torch.Tensor]:
    """`linear_cross_entropy` as it was at git revision `rev`, loaded beside today's (its operators renamed), so
    that one run times both."""
    tag = "".join(c for c in rev if c.isalnum())
    name = f"remat._sites._cross_entropy_{tag}"
    if name in sys.modules:  # loaded before in this process: its operators are registered already
        loaded: Callable[..., torch.Tensor] = sys.modules[name].linear_cross_entropy
        return loaded
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "show", f"{rev}:remat/_sites/cross_entropy.py"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    source = source.replace('"remat::linear_cross_entropy', f'"remat_{tag}::linear_cross_entropy')
    module = types.ModuleType(name)
    module.__package__ = "remat._sites"
    sys.modules[name] = module
    exec(compile(source, f"{rev}:remat/_sites/cross_entropy.py", "exec"), module.__dict__)
    function: Callable[..., torch.Tensor] = module.linear_cross_entropy
    return function


def sweep(
    repeats: int = 3, tokens: int = BATCH * SEQ, *, width: int = D, vocabulary: int = VOCAB,
    rows: Sequence[int] = SWEEP_ROWS, against: str | None = None, device: str = "cpu", autocast: bool = False,
) -> list[dict[str, Any]]:
    """The head and the loss alone, per rows of a chunk (see the module's docstring): one dict per row, with
    `label`, `rows`, `chunks`, `peak_bytes`, `seconds` (median) and, with `against`, `before_seconds` (the same
    chunks through `linear_cross_entropy` at that git revision)."""
    dev = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=generator).to(dev)
    weight = (torch.randn(vocabulary, width, generator=generator) * 0.02).to(dev)
    labels = torch.randint(0, vocabulary, (tokens,), generator=generator).to(dev)
    before = None if against is None else _before(against)

    def plain(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, w).float(), labels)

    def chunked(count: int | None, function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return lambda h, w: function(h, w, labels, chunks=count)

    default = chunk_count(tokens, vocabulary, torch.float32, dev.type)
    cases: list[dict[str, Any]] = [{"label": "F.cross_entropy(F.linear(...))", "rows": tokens, "chunks": 0,
                                    "run": plain}]
    counts = sorted({-(-tokens // r) for r in rows if r <= tokens} | {default}, reverse=True)
    for count in counts:
        size = -(-tokens // count)
        case: dict[str, Any] = {"label": f"{size} rows" + (" (chunks=None)" if count == default else ""),
                                "rows": size, "chunks": count, "run": chunked(count, remat.linear_cross_entropy)}
        if before is not None:
            case["before"] = chunked(count, before)
        cases.append(case)

    def step(fn: Callable[..., torch.Tensor]) -> float:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        _synchronize(dev)
        start = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            loss = fn(h, w)
        torch.autograd.backward(loss)
        _synchronize(dev)
        return time.perf_counter() - start

    for case in cases:
        step(case["run"])  # warm-up
        with remat.track() as tracker:
            step(case["run"])
        case["peak_bytes"] = tracker.peak(dev.type) if dev.type != "cpu" else tracker.peak_bytes
        case["times"], case["before_times"] = [], []
    for _ in range(repeats):
        for case in cases:
            case["times"].append(step(case["run"]))
            if "before" in case:
                case["before_times"].append(step(case["before"]))
    for case in cases:
        case["seconds"] = statistics.median(case.pop("times"))
        times = case.pop("before_times")
        if times:
            case["before_seconds"] = statistics.median(times)
        case.pop("run")
        case.pop("before", None)
    return cases


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def format_sweep(cases: list[dict[str, Any]], *, tokens: int = BATCH * SEQ, width: int = D,
                 vocabulary: int = VOCAB, device: str = "cpu", autocast: bool = False,
                 against: str | None = None) -> str:
    kind = "bf16 autocast" if autocast else "float32"
    lines = [f"the head and the loss alone: {tokens:,} tokens, width {width}, {vocabulary:,} classes, {kind}, "
             f"{device}, {torch.get_num_threads()} thread(s); median of interleaved steps; peak: remat.track",
             f"{'configuration':34s} {'chunks':>6s} {'chunk logits':>12s} {'peak':>11s} {'step':>9s} {'vs plain':>9s}"
             + (f" {'at ' + against:>14s} {'now/then':>9s}" if against else "")]
    plain = cases[0]["seconds"]
    for case in cases:
        logits = case["rows"] * vocabulary * 4
        line = (f"{case['label']:34s} {case['chunks'] or '-':>6} {format_bytes(logits):>12s} "
                f"{format_bytes(case['peak_bytes']):>11s} {case['seconds'] * 1e3:7.0f}ms "
                f"{case['seconds'] / plain:8.2f}x")
        if "before_seconds" in case:
            line += f" {case['before_seconds'] * 1e3:12.0f}ms {case['seconds'] / case['before_seconds']:8.2f}x"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Print the table; exit status 1 where `--check` is given and a target does not hold."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.head", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per configuration (median shown)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--check", action="store_true", help="exit with status 1 when a target does not hold")
    parser.add_argument("--sweep", action="store_true", help="the head and the loss alone, per rows of a chunk")
    parser.add_argument("--width", type=int, default=D, help="--sweep: the head's input width")
    parser.add_argument("--vocabulary", type=int, default=VOCAB, help="--sweep: classes")
    parser.add_argument("--device", default="cpu", help="--sweep: where to run (cuda on a GPU)")
    parser.add_argument("--autocast", action="store_true", help="--sweep: under bf16 autocast")
    parser.add_argument("--against", metavar="REV", help="--sweep: also time linear_cross_entropy at git REV")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sweep:
        tokens = args.batch * args.seq
        cases = sweep(args.repeats, tokens, width=args.width, vocabulary=args.vocabulary, against=args.against,
                      device=args.device, autocast=args.autocast)
        print(format_sweep(cases, tokens=tokens, width=args.width, vocabulary=args.vocabulary, device=args.device,
                           autocast=args.autocast, against=args.against), file=out or sys.stdout)
        return 0
    result = measure(args.repeats, args.batch, args.seq)
    print(format_result(result), file=out or sys.stdout)
    return 1 if args.check and not targets_hold(result) else 0


if __name__ == "__main__":
    raise SystemExit(main())
