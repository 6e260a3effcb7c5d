"""The benchmark's rows: how each configuration rematerializes a fresh copy of a model (a registry)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import remat
from remat._core.units import format_bytes
from remat._demo import BenchModel

__all__ = ["CONFIGS", "NO_REMAT", "SEED", "TORCH", "Config", "Sequential", "register"]

SEED = 1234
NO_REMAT = "no remat"
TORCH = "torch.utils.checkpoint"


# -- the registry of configurations --------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One benchmark row: how to rematerialize the blocks of a fresh copy of a model.

    Attributes:
        name: The row's label.
        prepare: Changes the copy in place: replaces ``model.call``, ``model.stack`` or the blocks,
            and returns a note for the table or None. It may raise ImportError/AttributeError when
            the feature is not available yet; the row then says so.
        wrap_tiny: How the tiny function is wrapped for the overhead rows, or None to
            leave this configuration out of them.
        models: Model names the row applies to; None for all.
    """

    name: str
    prepare: Callable[[BenchModel], str | None]
    wrap_tiny: Callable[[Callable[[torch.Tensor], torch.Tensor]], Callable[[torch.Tensor], torch.Tensor]] | None = None
    models: tuple[str, ...] | None = None


CONFIGS: list[Config] = []


def register(config: Config) -> Config:
    """Add a configuration (a row) to the benchmark; a later one with the same name replaces it.

    Example:
        >>> from benchmarks.configs import Config, register, CONFIGS
        >>> _ = register(Config("plain again", lambda model: None, models=("gpt",)))
        >>> CONFIGS[-1].name
        'plain again'
        >>> _ = CONFIGS.pop()
    """
    for i, existing in enumerate(CONFIGS):
        if existing.name == config.name:
            CONFIGS[i] = config
            return config
    CONFIGS.append(config)
    return config


def _torch_call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = checkpoint(block, x, use_reentrant=False)
    return out


def _torch_tiny(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def wrapped(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(fn, x, use_reentrant=False)
        return out

    return wrapped


def _remat_blocks(model: BenchModel) -> str | None:
    for block in model.blocks:
        remat.remat(block)
    return None


def _remat_tiny(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return remat.remat(fn)


def _region_call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with remat.region():
        out: torch.Tensor = block(x)
    return out


def _region_blocks(model: BenchModel) -> str | None:
    model.call = _region_call
    return None


def _region_tiny(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def wrapped(x: torch.Tensor) -> torch.Tensor:
        with remat.region():
            return fn(x)

    return wrapped


def _save_matmuls_blocks(model: BenchModel) -> str | None:
    for block in model.blocks:
        remat.remat(policy=remat.policies.save_matmuls)(block)
    return None


def _chain_blocks(model: BenchModel) -> str | None:
    with torch.no_grad():
        sample = model.embed(*model.sample(next(model.parameters()).device, seed=SEED))
    try:
        model.stack = remat.chain(list(model.blocks), budget=0.5, sample=sample)
    except remat.BudgetError as e:
        smallest = e.least_bytes
        if smallest is None:
            raise
        budget = smallest
        model.stack = remat.chain(list(model.blocks), budget=budget, sample=sample)
        return f"50% is below the smallest budget; ran at that, {format_bytes(budget)}"
    return None


class Sequential(nn.Module):
    def __init__(self, blocks: nn.ModuleList, segments: int) -> None:
        super().__init__()
        self.blocks, self.segments = blocks, segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        run = cast(Callable[..., torch.Tensor], checkpoint_sequential)
        return run(list(self.blocks), self.segments, x, use_reentrant=False)


def _sequential_blocks(model: BenchModel) -> str | None:
    model.stack = Sequential(model.blocks, max(1, round(math.sqrt(len(model.blocks)))))
    return None


def _torch_blocks(model: BenchModel) -> str | None:
    model.call = _torch_call
    return None


register(Config(NO_REMAT, lambda model: None, wrap_tiny=lambda fn: fn))
register(Config(TORCH, _torch_blocks, wrap_tiny=_torch_tiny))
register(Config("@remat", _remat_blocks, wrap_tiny=_remat_tiny))
register(Config("remat.region", _region_blocks, wrap_tiny=_region_tiny))
register(Config("@remat(policy=save_matmuls)", _save_matmuls_blocks))
register(Config("checkpoint_sequential, √n segments", _sequential_blocks))
register(Config("remat.chain(budget=0.5)", _chain_blocks))
