"""`python -m benchmarks --model estimate`: `remat.estimate` against real steps.

``python -m benchmarks --model estimate`` checks the predictions: for every configuration of the GPT-like stack
and the convnet (remat/_demo.py) and of tiny GPT-2 and Llama configs, the predicted peak and activation bytes next
to those of a real CPU step of the same model, counted with `remat.track` (NOTE [ What a real step counts ]), and
their ratio.

NOTE [ What a real step counts ]
The real step is the one `remat.estimate` predicts (NOTE [ What an estimate runs ] in remat/_estimate/predict.py):
a warm-up optimizer step on zero gradients makes the optimizer's state, then one tracked step runs forward,
the loss, lets go of the model's output (as ``loss = model(batch).loss`` does), backward, the optimizer step and
``zero_grad``. The bytes alive before it (parameters, buffers, the batch, the optimizer's state) are counted from
their storages, and the tracker adds the step's own peak.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TextIO

import torch
from torch import nn

import remat
from remat._core.torch_compat import tree_leaves
from remat._core.units import format_bytes
from remat._estimate.estimate import is_budget
from remat._estimate_cli import HF_KINDS, SEED, Case, bench_case, hf_case
from remat._measure.loss import call_model as _call
from remat._measure.loss import default_loss

__all__ = [
    "HF_KINDS", "Case", "Checked", "Measured", "bench_case", "check", "compare_main", "format_checks", "hf_case",
    "measure_step", "run_checks",
]

CONFIGS: tuple[Any, ...] = ("none", "full", "save_matmuls")
BUDGET = 0.6
"""The budget configuration `--model estimate` checks on the benchmark's models (a fraction of no remat's peak).

The real step plans on its own profile, whose times differ from the fake one's, so the two plans may pick
different blocks; both fit the budget, and their peaks agree within the target."""


# -- a real step ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """Bytes of a real training step (NOTE [ What a real step counts ])."""

    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    peak_bytes: int
    output_bytes: int = 0


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _optimizer(kind: str | None, params: list[nn.Parameter]) -> torch.optim.Optimizer | None:
    trainable = [p for p in params if p.requires_grad]
    if kind is None:
        return None
    if kind == "sgd":
        return torch.optim.SGD(trainable, lr=0.01, momentum=0.9)
    made: torch.optim.Optimizer = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind](trainable)
    return made


def measure_step(case: Case, config: Any, optimizer: str | None = "adamw", seed: int = SEED,
                 autocast: Callable[[], AbstractContextManager[Any]] | None = None) -> Measured:
    """Run one real training step of ``case`` under ``config`` ("none", "full", "save_matmuls", a policy, a budget).

    With ``autocast`` (e.g. ``lambda: torch.autocast("cpu", dtype=torch.bfloat16)``), the forward and the loss run
    in a region of it, backward and the optimizer step outside, as torch's AMP recipe writes a step. The model's
    weights change (the optimizer steps); its remat sites are removed afterwards.
    """
    model = case.model
    params = list(model.parameters())
    opt = _optimizer(optimizer, params)
    if opt is not None:
        for p in params:
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = [t for s in (opt.state.values() if opt else ()) for t in tree_leaves(s) if isinstance(t, torch.Tensor)]
    inputs = [t for t in tree_leaves(case.sample) if isinstance(t, torch.Tensor)]
    base = _storage_bytes([*params, *model.buffers(), *inputs, *state])
    if config == "none":
        switch = remat.enabled(False)
    elif is_budget(config):
        remat.apply(model, case.where, budget=config, sample=case.sample, loss=case.loss)
        switch = remat.enabled(True)
    else:
        policy = remat.policies.save_matmuls if config == "save_matmuls" else None if config == "full" else config
        remat.apply(model, case.where, policy=policy)
        switch = remat.enabled(True)
    try:
        torch.manual_seed(seed)
        with switch, remat.track() as t:
            with autocast() if autocast is not None else contextlib.nullcontext():
                out = _call(model, case.sample)
                value = case.loss(out) if case.loss is not None else default_loss(out)
            with_output = t.current_bytes
            del out
            held = t.current_bytes - sum(t.bytes_of([value]).values())
            output = with_output - t.current_bytes
            torch.autograd.backward(value)
            grads = _storage_bytes([p.grad for p in params if p.grad is not None])
            del value
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        remat.undo(model)
    return Measured(grads, _storage_bytes(state), held, base + t.peak_bytes, output)


# -- predicted against measured ----------------------------------------------------------------


@dataclass(frozen=True)
class Checked:
    """One configuration of one model: predicted and measured bytes."""

    model: str
    config: str
    predicted: remat.ConfigEstimate
    measured: Measured

    @property
    def peak_ratio(self) -> float:
        """Predicted / measured peak."""
        return self.predicted.peak_bytes / self.measured.peak_bytes

    @property
    def activation_ratio(self) -> float:
        """Predicted / measured activation bytes."""
        return self.predicted.activation_bytes / max(self.measured.activation_bytes, 1)


def check(case: Case, build: Callable[[], Case], configs: Sequence[Any] = CONFIGS,
          optimizer: str | None = "adamw") -> list[Checked]:
    """Estimate ``case`` and measure each configuration on a fresh ``build()`` of the same model."""
    report = remat.estimate(case.model, case.sample, loss=case.loss, optimizer=optimizer, configs=configs,
                            where=case.where)
    rows = []
    for config in configs:
        measured = measure_step(build(), config, optimizer)
        rows.append(Checked(case.name, report[config].label, report[config], measured))
    return rows


BENCH_MODELS = ("gpt", "convnet")


def _cases() -> list[tuple[str, Callable[[], Case]]]:
    cases: list[tuple[str, Callable[[], Case]]] = [
        ("gpt", lambda: bench_case("gpt")),
        ("convnet", lambda: bench_case("convnet")),
    ]
    try:
        import transformers  # noqa: F401
    except ImportError:
        return cases
    return [*cases,
            *((kind, lambda kind=kind: hf_case(kind, tiny=True, seq=64, batch=2, device="cpu")) for kind in HF_KINDS)]


def run_checks(progress: Callable[[str], None] = lambda message: None) -> list[Checked]:
    """Predicted against measured for every configuration of every model of ``--model estimate``."""
    rows: list[Checked] = []
    for name, build in _cases():
        progress(f"estimate: {name}")
        rows += check(build(), build, configs=(*CONFIGS, BUDGET) if name in BENCH_MODELS else CONFIGS)
    return rows


def format_checks(rows: Sequence[Checked]) -> str:
    """The table of ``python -m benchmarks --model estimate``."""
    fmt = format_bytes
    header = ("model", "config", "predicted peak", "measured peak", "ratio", "pred. activations",
              "meas. activations", "ratio")
    table = [header, *((r.model, r.config, fmt(r.predicted.peak_bytes), fmt(r.measured.peak_bytes),
                        f"{r.peak_ratio:.4f}", fmt(r.predicted.activation_bytes),
                        fmt(r.measured.activation_bytes), f"{r.activation_ratio:.4f}") for r in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["remat.estimate against a real CPU step (remat.track), AdamW, float32; target: ratios within "
             "0.95-1.05"]
    for row in table:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]),
                 *(c.rjust(w) for c, w in zip(row[2:], widths[2:], strict=True))]
        lines.append("  ".join(cells).rstrip())
    worst = max((abs(r.peak_ratio - 1) for r in rows), default=0.0)
    lines.append(f"worst peak ratio off by {worst:.2%}")
    return "\n".join(lines)


def compare_main(stdout: TextIO, progress: Callable[[str], None]) -> int:
    """Run ``python -m benchmarks --model estimate``: predicted against measured."""
    print(format_checks(run_checks(progress)), file=stdout)
    return 0
