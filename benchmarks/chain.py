"""`remat.chain` at 50% of a chain's activation memory against every `checkpoint_sequential`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import remat
from remat._core.units import format_bytes
from remat._demo import BenchModel, human_count, parameter_count
from tests.models import ChainNet

from .configs import NO_REMAT, SEED, Config, Sequential
from .runner import Result, bench_model

__all__ = ["CHAIN", "CHAIN_BUDGET", "bench_chain"]


CHAIN_BUDGET = 0.5
CHAIN = f"remat.chain(budget={CHAIN_BUDGET})"


def _sequential_name(k: int) -> str:
    return f"checkpoint_sequential, {k} segment{'s' if k > 1 else ''}"


def bench_chain(
    base: ChainNet, device: torch.device, repeats: int, progress: Callable[[str], None]
) -> tuple[str, dict[str, Any], list[Result]]:
    """On `ChainNet`: `remat.chain` at 50% of the chain's activation memory, against
    torch's `checkpoint_sequential` (``use_reentrant=False``) with every segment count 1..n.

    Every configuration is a row of `bench_model` (same peak definition, interleaved repeats). The
    table keeps no remat, the chain and the fastest ``checkpoint_sequential`` whose measured peak is
    at most the chain's; the whole sweep, the budget and the plan's predictions go to the returned
    summary (the ``chain`` entry of the JSON metadata).
    """
    n = len(base.blocks)
    chains: list[remat.Chain] = []

    def chained(model: BenchModel) -> str | None:
        sample = model.sample(device, seed=SEED)[0]
        note = None
        try:
            built = remat.chain(list(model.blocks), budget=CHAIN_BUDGET, sample=sample)
        except remat.BudgetError as e:
            smallest = e.least_bytes
            if smallest is None:
                raise
            built = remat.chain(list(model.blocks), budget=smallest, sample=sample)
            note = (f"BUDGET MOVED: {CHAIN_BUDGET:.0%} is below the smallest feasible budget; ran at "
                    f"{format_bytes(smallest)}")
        model.stack = built
        chains.append(built)
        return note

    def sequential(k: int) -> Callable[[BenchModel], str | None]:
        def prepare(model: BenchModel) -> str | None:
            model.stack = Sequential(model.blocks, k)
            return None

        return prepare

    configs = [
        Config(NO_REMAT, lambda model: None),
        Config(CHAIN, chained),
        *(Config(_sequential_name(k), sequential(k)) for k in range(1, n + 1)),
    ]
    description = f"{base.describe()} ({human_count(parameter_count(base))} parameters, float32)"
    rows = bench_model("chain", base, device, repeats, configs, progress)
    by_name = {r.config: r for r in rows}
    none, ours = by_name[NO_REMAT], by_name[CHAIN]
    sweep = [by_name[_sequential_name(k)] for k in range(1, n + 1)]
    summary: dict[str, Any] = {
        "budget_fraction": CHAIN_BUDGET,
        "sequential": "torch.utils.checkpoint.checkpoint_sequential(use_reentrant=False)",
        "sweep": [{"segments": k + 1, "peak_bytes": r.peak_bytes, "step_median_seconds": r.step}
                  for k, r in enumerate(sweep)],
    }  # fmt: skip
    shown = [none, ours]
    if not chains or ours.peak_bytes is None or ours.step is None:
        return description, summary, shown + sweep
    plan = chains[0].schedule
    assert plan is not None
    input_bytes, budget = plan.input_bytes, plan.budget
    assert budget is not None
    # The budget counts the chain's input (NOTE [ Memory model ] in remat/_chain/simulate.py); the measured peak does
    # not (the batch exists before the step), so it is added back to compare like with like.
    counted = ours.peak_bytes + input_bytes
    baseline = remat.Schedule.no_remat(plan.stages, input_bytes=input_bytes)
    summary.update(
        budget_bytes=budget,
        input_bytes=input_bytes,
        predicted_peak_bytes=plan.peak_bytes,
        measured_peak_bytes=ours.peak_bytes,
        peak_over_budget=counted / budget,
        predicted_seconds=plan.makespan,
        measured_seconds=ours.step,
        predicted_over_measured=plan.makespan / ours.step,
        extra_forwards=plan.extra_forwards(),
        no_remat_predicted_peak_bytes=baseline.peak_bytes,
        no_remat_measured_peak_bytes=none.peak_bytes,
        no_remat_predicted_seconds=baseline.makespan,
        no_remat_measured_seconds=none.step,
    )
    summary.update(
        # The chain returns its parameters' gradients to autograd when its backward ends, so a copy of
        # them is alive on top of the zero-filled .grad (see NOTE [ What the memory columns count ]):
        # what the measured peak adds to the plan's, which counts activations only.
        parameter_bytes=sum(p.numel() * p.element_size() for p in base.parameters()),
        measured_minus_predicted_bytes=counted - plan.peak_bytes,
    )
    ours.note = "; ".join(
        filter(None, [
            ours.note,
            f"peak+input/budget {counted / budget:.3f} (budget {format_bytes(budget)}, target ≤ 1.05)",
            f"predicted/measured time {plan.makespan / ours.step:.2f} (target: within 15%)",
        ])
    )  # fmt: skip
    if none.step is not None:
        none.note = f"predicted/measured time {baseline.makespan / none.step:.2f} (the chain's profile, no remat)"
    fits = [(r.step, k + 1, r) for k, r in enumerate(sweep) if r.step is not None and r.peak_bytes is not None
            and r.peak_bytes <= ours.peak_bytes]  # fmt: skip
    if not fits:
        summary["best_sequential"] = None
        ours.note += "; no checkpoint_sequential fits its peak"
        return description, summary, shown
    _, k, best = min(fits, key=lambda fit: fit[0])
    assert best.step is not None
    best.config = f"{_sequential_name(k)} (best fitting)"
    best.note = f"fastest k of 1..{n} with peak ≤ the chain's; chain time/this "
    best.note += f"{ours.step / best.step:.2f}x (target ≤ 1)"
    summary.update(best_sequential=k, best_sequential_seconds=best.step, chain_over_sequential=ours.step / best.step)
    return description, summary, [*shown, best]
