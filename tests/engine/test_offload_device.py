"""Offload off a device (docs/guides/offload.md), on the device written in Python (tests/pydevice.py).

The device has no streams, so copies take the synchronous path (as on MPS) into host memory that is not
pinned: `remat.offload()` and `offload=True` on sites move what autograd keeps to host, the device's live bytes
(counted by `remat.track`) drop by exactly the bytes of the host copies, and outputs, gradients and every
generator after backward (dropout runs on the device) equal a run without remat.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_on_device, randn
from torch import nn

import remat
from remat import policies
from remat._engine import transfer as _transfer

pytestmark = pytest.mark.usefixtures("test_device")

D0 = "remat_test:0"
WIDTH = 64  # a (32, 64) float64 activation holds 16 KiB, above offload's default floor of 1 KiB


class Block(nn.Module):
    """Linear, GELU, dropout, linear: what it saves are activations (the output itself is saved by nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.dropout(F.gelu(self.up(x)), 0.3, self.training))


def stack() -> nn.Module:
    return nn.Sequential(Block(), Block(), Block()).double().to(D0)


def x0() -> torch.Tensor:
    return randn(32, WIDTH, requires_grad=True).to(D0)


@pytest.fixture(autouse=True)
def _nothing_left_on_the_host() -> Iterator[None]:
    yield
    gc.collect()
    assert _transfer.live_parcels() == 0, "a host copy outlived its graph"


def in_context(offload: AbstractContextManager[Any]) -> Callable[[Any], Callable[..., Any]]:
    def variant(target: Any) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            with offload:
                return target(*args)

        return call

    return variant


def held_and_moved(model: nn.Module, offload: AbstractContextManager[Any]) -> tuple[int, int]:
    """Bytes live on the device after forward (counted by `remat.track`), and bytes of host copies made."""
    host = _transfer.offloaded_bytes()[0]
    with remat.track() as tracker:
        x = randn(32, WIDTH).to(D0).requires_grad_() * 2  # an activation: the user's leaf is never offloaded
        with offload:
            y = model(x).sum()
        del x
        held = tracker.current(D0)
    moved = _transfer.offloaded_bytes()[0] - host
    y.backward()
    return held, moved


def test_the_device_copies_without_streams() -> None:
    lane = _transfer._lane(torch.device(D0))
    assert lane.module is torch.cpu, "a device without streams takes the synchronous path"
    assert not lane.pending


def test_offload_block_moves_what_autograd_keeps_to_host() -> None:
    torch.manual_seed(0)
    model = stack()
    plain, nothing = held_and_moved(model, nullcontext())
    offloaded, moved = held_and_moved(model, remat.offload())
    assert nothing == 0 and moved > 0
    assert plain - offloaded == moved, "the device's live bytes drop by what went to host"


def test_offload_block_gives_the_gradients_and_masks_of_no_remat() -> None:
    base, _ = assert_same_on_device(stack, (x0(),), in_context(remat.offload()), expect_recompute=False)
    assert base.drew[1], "dropout drew on index 0"


@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_offloading_sites_hold_their_inputs_on_the_host(strategy: str) -> None:
    torch.manual_seed(0)
    model = stack()
    remat.apply(model, Block, strategy=strategy)
    kept, nothing = held_and_moved(model, nullcontext())
    remat.undo(model)
    remat.apply(model, Block, strategy=strategy, offload=True)
    offloaded, moved = held_and_moved(model, nullcontext())
    activation = 32 * WIDTH * 8
    assert nothing == 0 and moved == 3 * activation, "the three blocks' inputs go to host, nothing else"
    assert kept - offloaded == moved


@pytest.mark.parametrize(
    "variant",
    [
        lambda m: remat.apply(m, Block, offload=True),
        lambda m: remat.apply(m, Block, offload=True, strategy="replay"),
        lambda m: remat.apply(m, Block, policy=policies.offload(policies.save_matmuls)),
        lambda m: remat.apply(m, Block, offload=True, policy=policies.offload(policies.save_matmuls)),
    ],
    ids=["apply", "apply_replay", "policy_offload", "both"],
)
def test_offloading_sites_give_the_gradients_and_masks_of_no_remat(variant: Callable[[Any], Any]) -> None:
    host = _transfer.offloaded_bytes(reset_peak=True)[0]
    base, _ = assert_same_on_device(stack, (x0(),), variant)
    assert base.drew[1]
    assert _transfer.offloaded_bytes()[1] > host, "nothing went to host"


class Attention(nn.Module):
    """q, k and v as views of one projection (strides of their own), attention with dropout on the device, a
    permuted output, and a sparse slice of a larger storage: the layouts that took torch's staged copy to
    pageable host memory, or crossed more than once, on a GPU (issue 44)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2).transpose(1, 2).sin()
        return y.reshape(b, s, d).repeat(1, 8, 1)[:, ::8].cos()


def test_every_copy_across_the_device_is_a_memcpy_and_crosses_once_each_way(monkeypatch: pytest.MonkeyPatch) -> None:
    between: list[tuple[bool, bool, bool, bool]] = []
    copy_ = torch.Tensor.copy_

    def spy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if self.device != src.device:
            same = (self.dtype == src.dtype, self.shape == src.shape)
            between.append((self.is_contiguous(), src.is_contiguous(), *same))
        return copy_(self, src, non_blocking)

    def make() -> nn.Module:
        return Attention().double().to(D0)

    x = randn(4, 16, WIDTH, requires_grad=True).to(D0)
    _transfer.traffic(reset=True)
    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    base, _ = assert_same_on_device(make, (x,), in_context(remat.offload()), expect_recompute=False)
    monkeypatch.undo()
    moved = _transfer.traffic()
    assert base.drew[1], "dropout drew on index 0"
    assert moved.out > 0 and (moved.back, moved.back_bytes) == (moved.out, moved.out_bytes)
    assert moved.kept == moved.pageable == 0, "a device without streams copies synchronously: nothing is held"
    assert len(between) == moved.out + moved.back
    assert all(copy == (True, True, True, True) for copy in between), between
