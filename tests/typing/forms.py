"""Checked by `mypy --strict` (see .ci/run), never run: every decorator form keeps its type."""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import assert_type

import remat as remat_module
from remat import remat


@remat
def bare(x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    return x * scale


@remat(strategy="replay", name="with-options")
def with_options(x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    return x, n


class Block(nn.Module):
    @remat
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.relu()


@remat
class Decorated(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.relu()


@remat(preserve_rng=False)
class DecoratedWithOptions(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.relu()


def forms() -> None:
    x = torch.zeros(2)
    assert_type(bare(x, scale=2.0), torch.Tensor)
    assert_type(with_options(x, 3), tuple[torch.Tensor, int])
    assert_type(Block().forward(x), torch.Tensor)
    assert_type(Decorated(), Decorated)
    assert_type(DecoratedWithOptions(), DecoratedWithOptions)
    layer = remat(nn.Linear(2, 2))
    assert_type(layer, nn.Linear)
    model = remat.apply(nn.Sequential(nn.Linear(2, 2)), nn.Linear, every=1)
    assert_type(model, nn.Sequential)
    with remat.region() as r:
        y = x.sin()
    assert_type(r.ops, int)
    assert_type(y, torch.Tensor)


@remat(policy=remat_module.policies.save_matmuls | remat_module.policies.save_tagged("h"))
def with_policy(x: torch.Tensor) -> torch.Tensor:
    return x.sin()
