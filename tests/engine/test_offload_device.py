"""Offload off a device (docs/guides/offload.md), on the device written in Python (tests/pydevice.py).

The device has no streams, so copies take the synchronous path (as on MPS) into host memory that is not
pinned: `remat.offload()` and `offload=True` on sites move what autograd keeps to host, the device's live bytes
(counted by `remat.track`) drop by exactly the bytes of the host copies, and outputs, gradients and every
generator after backward (dropout runs on the device) equal a run without remat.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
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


# -- the peak: remat.offload() against torch's save_on_cpu -------------------------------------------------------


class _Link:
    """The device module of an asynchronous lane on the Python device: streams and events, where a copy to host
    finishes only when a stream waits for it, never on its own (the slowest host link there is)."""

    class Event:
        def __init__(self) -> None:
            self.done = False

        def query(self) -> bool:
            return self.done

    class Stream:
        def wait_stream(self, other: Any) -> None:
            pass

        def record_event(self) -> _Link.Event:
            return _Link.Event()

        def wait_event(self, event: _Link.Event) -> None:
            event.done = True  # what the waiting stream runs next sees the copy done (the copies here are eager)

    def __init__(self) -> None:
        self.compute = _Link.Stream()

    def current_stream(self, device: Any = None) -> _Link.Stream:
        return self.compute

    @contextmanager
    def stream(self, stream: _Link.Stream) -> Iterator[None]:
        yield


def slow_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give the device's lane streams (`_Link`): copies stay in flight until a stream waits for them."""
    lane = _transfer._Lane(torch.device(D0))
    link = _Link()
    lane.module, lane.asynchronous = link, True
    lane.out_stream, lane.back_stream = _Link.Stream(), _Link.Stream()
    monkeypatch.setitem(_transfer._lanes, torch.device(D0), lane)


def gpt_like() -> nn.Module:
    """The GPT-like stack of the offload benchmark (benchmarks/offload.py), small: four blocks of width 128."""
    from remat._demo import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(blocks=4, d=128, heads=4, seq=128, batch=8, vocab=256, dropout=0.1)).to(D0).train()


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.parametrize("link", ["synchronous", "slow"])
def test_the_offload_block_peaks_as_save_on_cpu(link: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Offload lifecycle ], rule 6: on the GPU the block peaked 1.33x save_on_cpu's (prefetch, copies in
    flight); here, with the device's live bytes counted by `remat.track`, within 1.05x: nothing brought back ahead
    and no copy in flight, whatever the link."""
    if link == "slow":
        slow_link(monkeypatch)
    base = gpt_like()
    batch = base.sample(torch.device(D0))  # type: ignore[operator]
    peaks: dict[str, int] = {}
    grads: dict[str, list[torch.Tensor]] = {}
    contexts: dict[str, Callable[[], AbstractContextManager[Any]]] = {
        "none": nullcontext,
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=False),
        "offload": lambda: remat.offload(pin_memory=False),
    }
    for name, context in contexts.items():
        model = copy.deepcopy(base)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # as the offload benchmark: gradients exist before the step
        torch.manual_seed(1)
        with remat.track() as tracker:
            with context():
                loss = model.loss(*batch)  # type: ignore[operator]
            loss.backward()
        peaks[name] = tracker.peak(D0)
        grads[name] = [p.grad.cpu() for p in model.parameters()]  # type: ignore[union-attr]
    assert peaks["save_on_cpu"] < peaks["none"] / 3, peaks
    assert peaks["offload"] <= 1.05 * peaks["save_on_cpu"], peaks
    for got, want in zip(grads["offload"], grads["none"], strict=True):
        torch.testing.assert_close(got, want)
