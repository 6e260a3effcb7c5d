"""Checked by `mypy --strict` (see .ci/run), never run: the offload forms keep their types."""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import assert_type

import remat as remat_module
from remat import remat


@remat(offload=True)
def offloaded(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@remat(offload=remat.offload(min_bytes=4096), policy=remat_module.policies.offload(remat_module.policies.save_matmuls))
def both(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


assert_type(offloaded(torch.ones(2)), torch.Tensor)
assert_type(both(torch.ones(2, 2), torch.ones(2, 2)), torch.Tensor)
assert_type(remat.apply(nn.Sequential(nn.Linear(2, 2)), offload=True), nn.Sequential)
assert_type(remat_module.offload(include_cpu=True), remat_module.Offload)
with remat.offload() as block:
    assert_type(block, remat_module.Offload)
with remat.region(offload=True):
    pass
