"""Checked by `mypy --strict` (see .ci/run), never run: both spellings of the package type-check (docs/api.md, its
opening paragraph)."""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import assert_type

import remat as package
from remat import remat


def through_the_decorator_object() -> None:
    x = torch.zeros(2, requires_grad=True)
    policy = remat.policies.save_matmuls | remat.policies.save_tagged("h")
    assert_type(policy, package.policies.Policy)
    assert_type(remat.tag(x, "h"), torch.Tensor)
    chain = remat.chain(nn.Sequential(nn.Linear(2, 2)), segments=1)
    assert_type(chain, package.Chain)
    assert_type(remat.measure(nn.Linear(2, 2), x), package.Report)
    with remat.track() as tracker:
        pass
    assert_type(tracker, package.Tracker)
    plan = remat.solve([remat.StageCost(1.0, 2.0, 8, 16)], 64, input_bytes=8)
    assert_type(plan, package.Schedule)
    error: type[package.RematError] = remat.BudgetError
    assert issubclass(remat.RecomputeMismatchError, remat.RematError) and error is not None
    assert_type(remat.remat, package.Remat)


def through_the_package() -> None:
    x = torch.zeros(2, requires_grad=True)
    assert_type(package.tag(x, "h"), torch.Tensor)
    with package.region(policy=package.policies.save_matmuls) as r:
        x.sin()
    assert_type(r, package.Region)
