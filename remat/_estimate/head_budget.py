"""The chunked head in budget and memory plans, where they need an estimate: NOTE [ The head as a choice ] in
remat/_budget/solve_head.py.

A fractional budget with `head=True` is a fraction of the step without remat with the model's own head, turned into
bytes here on fake tensors before the head is routed; `remat.apply(model, memory=...)` refuses a memory only where
full remat does not fit with the head in chunks either (the least a model whose head can be routed reaches).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from .._sites.head import can_route_head
from .estimate import estimate
from .long_sequences import HEAD
from .predict import OptimizerLike
from .report import ConfigEstimate

__all__ = ["full_with_head", "plain_budget"]


def plain_budget(model: nn.Module, fraction: float, sample: Any, loss: Callable[[Any], Any] | None,
                 where: Any) -> int:
    """`fraction` of the step's peak without remat with the model's own head, above the step's start (the state
    left out, as a budget counts): an estimate on fake tensors."""
    row = estimate(model, sample, loss=loss, configs=("none",), where=where)["none"]
    return max(1, int(fraction * (row.peak_bytes - row.params_bytes - row.buffers_bytes - row.input_bytes)))


def full_with_head(model: nn.Module, sample: Any, loss: Callable[[Any], Any] | None, optimizer: OptimizerLike,
                   where: Any) -> ConfigEstimate | None:
    """The estimate of full remat with the head in chunks, where the model has a head to route; else None."""
    if not can_route_head(model):
        return None
    config = "full" + HEAD
    return estimate(model, sample, loss=loss, optimizer=optimizer, configs=(config,), where=where)[config]
