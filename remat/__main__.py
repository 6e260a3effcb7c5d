"""``python -m remat``: a first look at what remat saves; ``python -m remat estimate``: a step's memory, predicted.

``python -m remat`` trains remat's built-in GPT-like model (remat/_demo.py) for a few steps under each
configuration (no remat, `torch.utils.checkpoint` on every block, `remat.apply(model)` with and without a policy,
a budget, and `remat.apply(model)` with the head and the loss in chunks, `remat.linear_cross_entropy`) and prints
one table: the step peak, the step time and whether its gradients are those of
no remat; then the one-liners that go further. It takes well under a minute on two CPU cores, with one torch
thread unless ``--threads`` says otherwise (two OpenMP threads stall each other on a busy machine), and
``--quick`` runs a tiny model, for a smoke test. ``python -m remat estimate`` prints `remat.estimate`'s table
(remat/_estimate_cli.py). The full benchmark, with the developers' targets, is ``python -m benchmarks`` in a clone
of the repository.

NOTE [ What the demonstration measures ]
1. Every configuration runs on its own copy of the same weights and the same batch, from the same seed, so the
   rows differ only by how activations are kept.
2. "step peak" is what `remat.apply(model, budget=...)` bounds (its budget is a fraction of this figure without
   remat): the most bytes live during one step (forward, loss, backward) above what was live when it began,
   counted by `remat.track`, with the gradients that backward allocates (they start as None, as a loop's
   ``optimizer.zero_grad()`` leaves them).
3. The first step of each configuration is the one measured for memory (a budget's plan holds from the first
   step on); it is not timed. "step" is the median of a few timed steps after it, taken in rounds across the
   configurations (``a b c a b c``), so that the machine's drift affects them alike.
4. "gradients equal" compares every parameter's gradient with no remat's: equal up to `GRAD_BOUND` of the
   largest of them (remat reruns the same kernels with the same RNG state; only a float sum's order may differ).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat

from ._core.units import format_bytes, ratio
from ._demo import GPT, GPT_SIZES, GPTConfig, human_count, parameter_count
from ._measure.measurement import format_seconds
from ._measure.track import synchronize

__all__ = ["main"]

SEED = 1234
BUDGET = 0.5
STEPS = 5
"""Timed steps per configuration (the median is shown)."""
DEMO = dataclasses.replace(GPT_SIZES["small"], vocab=8192)
"""The demonstration's model: the benchmark's small GPT with a vocabulary of 8,192 words, so that its head and loss
weigh in its step as a language model's do (full remat of the blocks leaves them: issue 45)."""
QUICK = GPTConfig(blocks=6, d=64, heads=2, seq=64, batch=4, vocab=64)
"""``--quick``'s model: a few seconds in all, for a smoke test."""
GRAD_BOUND = 1e-4
"""The largest difference from no remat's gradients that still reads "yes", as a fraction of the largest of them
(at least 1): see NOTE [ What the demonstration measures ], rule 4."""
BUDGET_LABEL = f"remat.apply(model, budget={BUDGET}, sample=x)"
TORCH_LABEL = "torch.utils.checkpoint, every block"
HEAD_CHUNKS = 8
"""The demonstration's logits are small next to `CHUNK_BYTES` (what `chunks=None` aims at, for real sizes): in this
many chunks, so that its row shows what chunks do."""
HEAD_LABEL = f"remat.apply(model) + linear_cross_entropy(chunks={HEAD_CHUNKS})"

GO_FURTHER = f"""\
Go further (docs/quickstart.md):
  @remat                                    on a function, a method or an nn.Module class
  remat(block)                              on one module instance, in place
  with remat.region(): ...                  on any stretch of code (its ops are replayed in backward)
  remat.apply(model)                        on every repeated block of a model (Hugging Face layers too)
  remat.linear_cross_entropy(h, w, labels)  the head and the loss in chunks (head=True: a Hugging Face LM's)
  {BUDGET_LABEL}  the fastest plan within {BUDGET:.0%} of no remat's step peak (or "6GiB")
  print(remat.plan(model))                  which blocks, and how
  remat.estimate(model, x)                  a step's memory per configuration, on fake tensors
  python -m remat estimate --help           the same from the command line (--hf llama: a 7B Llama)
  python -m benchmarks                      the full tables and remat's targets (in a clone of the repo)"""


@dataclass
class _Result:
    """One configuration: its model and what its steps measured."""

    label: str
    model: GPT
    peak_bytes: int = 0
    grads: list[torch.Tensor] = field(default_factory=list)
    grads_equal: bool | None = None
    seconds: list[float] = field(default_factory=list)


def _with_torch_checkpoint(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = checkpoint(block, x, use_reentrant=False)
    return out


def _configurations(
    batch: Sequence[torch.Tensor],
) -> list[tuple[str, Callable[[GPT], object]]]:
    idx, targets = batch

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def torch_blocks(model: GPT) -> None:
        model.call = _with_torch_checkpoint

    def chunked_head(model: GPT) -> None:
        remat.apply(model)
        model.head_chunks = HEAD_CHUNKS

    return [
        ("no remat", lambda model: None),
        (TORCH_LABEL, torch_blocks),
        ("remat.apply(model)", lambda model: remat.apply(model)),
        ("remat.apply(model, policy=save_matmuls)",
         lambda model: remat.apply(model, policy=remat.policies.save_matmuls)),
        (BUDGET_LABEL, lambda model: remat.apply(model, budget=BUDGET, sample=idx, loss=loss)),
        (HEAD_LABEL, chunked_head),
    ]


def _train_step(model: GPT, batch: Sequence[torch.Tensor], device: torch.device) -> float:
    for p in model.parameters():
        p.grad = None  # NOTE [ What the demonstration measures ], rule 2
    synchronize([device])
    start = time.perf_counter()
    torch.autograd.backward(model.loss(*batch))
    synchronize([device])
    return time.perf_counter() - start


def _tracked_step(row: _Result, batch: Sequence[torch.Tensor]) -> None:
    for p in row.model.parameters():
        p.grad = None
    torch.manual_seed(SEED)
    with remat.track() as tracker:
        loss = row.model.loss(*batch)
        torch.autograd.backward(loss)
        del loss
    row.peak_bytes = tracker.peak_bytes
    row.grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in row.model.parameters()]


def _same_grads(grads: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> bool:
    scale = max((float(r.abs().max()) for r in reference if r.numel()), default=0.0)
    diff = max((float((g - r).abs().max()) for g, r in zip(grads, reference, strict=True) if g.numel()), default=0.0)
    return diff <= GRAD_BOUND * max(1.0, scale)  # False for NaN too


class _Status:
    """One status line on a terminal's stderr, rewritten in place and cleared at the end; nothing elsewhere."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.width = stream, 0
        self.tty = stream.isatty()

    def __call__(self, message: str) -> None:
        if self.tty:
            self.stream.write("\r" + message.ljust(self.width))
            self.width = len(message)
            self.stream.flush()

    def done(self) -> None:
        self("")


def _table(rows: Sequence[_Result]) -> list[str]:
    none = rows[0]
    base = statistics.median(none.seconds)
    table = [("configuration", "step peak", "vs none", "step time", "vs none", "gradients equal")]
    for row in rows:
        step = statistics.median(row.seconds)
        equal = "(the reference)" if row.grads_equal is None else "yes" if row.grads_equal else "NO"
        table.append((row.label, format_bytes(row.peak_bytes), ratio(row.peak_bytes, none.peak_bytes, "x"),
                      format_seconds(step), ratio(step, base, "x"), equal))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return [
        "  ".join([line[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(line[1:5], widths[1:5], strict=True)),
                   line[5]])
        for line in table
    ]


def demo(device: torch.device, config: GPTConfig, steps: int, out: TextIO) -> int:
    """Run the demonstration on ``device`` with a GPT-like model of ``config``; return the exit status."""
    status = _Status(sys.stderr)
    torch.manual_seed(SEED)
    base = GPT(config).to(device).train()
    batch = base.sample(device, seed=SEED)
    threads = torch.get_num_threads()
    where = f"{device}, {threads} thread{'s' * (threads > 1)}" if device.type == "cpu" else str(device)
    print(f"remat {remat.__version__} on {where} (torch {torch.__version__}): a GPT-like model,", file=out)
    print(f"{base.describe()}, vocabulary {config.vocab:,} ({human_count(parameter_count(base))} parameters, "
          "float32).", file=out, flush=True)
    if not remat.is_enabled():
        print("remat is switched off (REMAT=0): its rows below run without remat.", file=out, flush=True)
    rows: list[_Result] = []
    planned: dict[str, float] = {}
    for label, configure in _configurations(batch):
        status(f"preparing {label}")
        row = _Result(label, copy.deepcopy(base))
        start = time.perf_counter()
        configure(row.model)
        planned[label] = time.perf_counter() - start
        status(f"memory of {label}")
        _tracked_step(row, batch)  # the first step: a budget's plan holds from it
        if rows:
            row.grads_equal = _same_grads(row.grads, rows[0].grads)
        rows.append(row)
    for r in range(steps):
        for row in rows:
            status(f"timing, round {r + 1} of {steps}: {row.label}")
            torch.manual_seed(SEED + r)
            row.seconds.append(_train_step(row.model, batch, device))
    status.done()
    by_label = {row.label: row for row in rows}
    none, theirs, full = by_label["no remat"], by_label[TORCH_LABEL], by_label["remat.apply(model)"]
    budget, head = by_label[BUDGET_LABEL], by_label[HEAD_LABEL]
    lines = [
        "Each configuration trains a copy of the same weights on the same batch. step peak: the most bytes",
        "live during one step (forward, loss, backward) above what was live before it, gradients included, as",
        f"remat.track counts them and a budget bounds them; step time: the median of {steps} timed steps;",
        "gradients equal: the same gradients as no remat's.",
        "",
        *_table(rows),
        "",
        f"remat.apply(model): {ratio(full.peak_bytes, none.peak_bytes, 'x')} of no remat's step peak "
        f"(torch.utils.checkpoint: {ratio(theirs.peak_bytes, none.peak_bytes, 'x')}), "
        f"{ratio(statistics.median(full.seconds), statistics.median(theirs.seconds), 'x')} torch's step time;",
        f"the budget's plan: {ratio(budget.peak_bytes, none.peak_bytes, 'x')} of no remat's step peak (asked: "
        f"{BUDGET:.2f}x), planned in {format_seconds(planned[BUDGET_LABEL])};",
        f"the head and the loss in {HEAD_CHUNKS} chunks too: {ratio(head.peak_bytes, full.peak_bytes, 'x')} of "
        f"remat.apply(model)'s step peak, the logits ({base.config.vocab:,} per token) never all alive.",
        "",
        GO_FURTHER,
    ]
    print("\n".join(lines), file=out)
    return 0 if all(row.grads_equal is not False for row in rows) else 1


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None) -> int:
    """Run ``python -m remat`` with command-line arguments ``argv``; return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    out = stdout or sys.stdout
    if argv[:1] == ["estimate"]:
        from ._estimate_cli import estimate_main

        return estimate_main(argv[1:], out)
    parser = argparse.ArgumentParser(
        prog="python -m remat",
        description="What remat saves on a built-in GPT-like model, against no remat and torch.utils.checkpoint. "
        "`python -m remat estimate --help`: a training step's memory, predicted; `python -m benchmarks` (in a "
        "clone of the repository): the full benchmark.",
    )
    parser.add_argument("--device", default="cpu", help="device to run on (default: cpu)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and two timed steps (a smoke test)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1, steady step times "
                        "on a busy machine, where two OpenMP threads stall each other)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"remat: cannot use --device {args.device}: {reason}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return demo(device, QUICK if args.quick else DEMO, 2 if args.quick else STEPS, out)
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    raise SystemExit(main())
