"""`remat.chain` inside a compiled frame: its schedule as torch checkpoint segments (NOTE [ Chains under compile ])."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._engine.compiled import torch_checkpoint
from .solver import Schedule

__all__ = ["lower", "run_lowered"]

# NOTE [ Chains under compile ]
# 1. Inside a compiled frame a chain follows the schedule made last in eager code: the stages that schedule runs with
#    grad in forward (`forward_save`) are kept, and each stage whose input the schedule checkpoints starts one torch
#    checkpoint that also covers the stages after it run without one (`forward_nosave`).
# 2. With no schedule yet (the chain was never called in eager code), every stage is its own checkpoint: nothing is
#    kept that a schedule could have dropped.
#
# Implementation notes:
# 1. (rule 1) A chain's schedule runs through one custom autograd function that dynamo cannot trace, and profiling a
#    new input shape runs stages forward and backward: neither can happen inside the frame.


def lower(schedule: Schedule | None, n: int) -> tuple[tuple[int, int, bool], ...]:
    """The schedule's forward as (first stage, end stage, recomputed) runs, in order."""
    kinds: list[str] = ["forward_checkpoint"] * n
    if schedule is not None:
        for op, i in schedule.ops[: schedule.ops.index(("loss", n))]:
            if op.startswith("forward"):
                kinds[i] = op
    runs: list[tuple[int, int, bool]] = []
    for i, kind in enumerate(kinds):
        if kind == "forward_nosave" and runs and runs[-1][2]:  # recomputed from the same kept input
            runs[-1] = (runs[-1][0], i + 1, True)
        else:
            runs.append((i, i + 1, kind != "forward_save"))
    return tuple(runs)


def _segment(stages: list[nn.Module], x: torch.Tensor) -> Any:
    for stage in stages:
        x = stage(x)
    return x


def run_lowered(
    stages: list[nn.Module], runs: tuple[tuple[int, int, bool], ...], x: torch.Tensor
) -> torch.Tensor:
    """Run the stages as `lower` split them: kept runs as they are, recomputed ones through torch's checkpoint."""
    for start, end, recomputed in runs:
        if recomputed:
            x = torch_checkpoint(_segment, (stages[start:end], x), {})
        else:
            x = _segment(stages[start:end], x)
    return x
