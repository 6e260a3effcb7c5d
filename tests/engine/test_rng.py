"""RNG on every device (docs/design.md, 'RNG, autocast and grad mode'): dropout masks in recompute equal forward's,
the user's RNG stream after backward equals a run without remat, and devices are found through
`torch.get_device_module`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_grads, randn, recomputes
from models import TransformerBlock
from torch import nn

import remat
from remat._engine import rng as _rng


def dropout_twice(x: torch.Tensor) -> torch.Tensor:
    return F.dropout(F.dropout(x.sin(), 0.5).exp(), 0.3)


def test_dropout_masks_match_in_recompute() -> None:
    masks: list[torch.Tensor] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        mask = F.dropout(torch.ones_like(x), 0.5)
        masks.append(mask)
        return (x.sin() * mask).exp()

    x = randn(64, requires_grad=True)
    remat.remat(fn)(x).sum().backward()
    assert len(masks) == 2, "forward and one recompute"
    assert torch.equal(masks[0], masks[1])
    assert 0 < int((masks[0] == 0).sum()) < 64


@pytest.mark.parametrize("variant", [remat.remat, remat.remat(preserve_rng=True, name="drop")])
def test_dropout_gradients_match_baseline(variant: Callable[[Any], Any]) -> None:
    assert_same_grads(lambda: dropout_twice, (randn(8, 8, requires_grad=True),), variant)


def test_transformer_with_dropout_and_attention_matches_baseline() -> None:
    assert_same_grads(TransformerBlock, (randn(2, 5, 8, requires_grad=True),), remat.remat)
    assert_same_grads(TransformerBlock, (randn(2, 5, 8, requires_grad=True),), lambda m: remat.apply(m, nn.Sequential))


def test_without_preserve_rng_the_masks_differ() -> None:
    """The control: with `preserve_rng=False` recompute draws new masks, so gradients are wrong."""
    x = randn(64, requires_grad=True)
    torch.manual_seed(0)
    remat.remat(preserve_rng=False, check=False)(dropout_twice)(x).sum().backward()
    wrong = x.grad
    x.grad = None
    torch.manual_seed(0)
    dropout_twice(x).sum().backward()
    assert not torch.allclose(wrong, x.grad)


def test_user_rng_stream_after_backward_equals_a_run_without_remat() -> None:
    draws = []
    for fn in (dropout_twice, remat.remat(dropout_twice)):
        torch.manual_seed(7)
        x = randn(16, requires_grad=True)
        fn(x).sum().backward()
        draws.append(torch.rand(5))
    torch.testing.assert_close(draws[1], draws[0], rtol=0, atol=0)


# -- devices through torch.get_device_module --------------------------------------------------------------
class FakeGenerator:
    """A device RNG module: its state is one integer per device index, advanced by `draw`."""

    def __init__(self) -> None:
        self.state: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []
        self.initialized = False  # never the current accelerator unless a test says so
        self.count = 2

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        self.calls.append(("count", -1, self.count))
        return self.count

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        index = torch.device(device).index or 0
        value = self.state.setdefault(index, 100 * index)
        self.calls.append(("get", index, value))
        return torch.tensor([value])

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        index = torch.device(device).index or 0
        self.state[index] = int(state[0])
        self.calls.append(("set", index, int(state[0])))

    def is_initialized(self) -> bool:
        return self.initialized

    def draw(self, index: int) -> int:
        value = self.state.setdefault(index, 100 * index)
        self.state[index] = value + 1
        return value


class OnDevice(torch.Tensor):
    """A tensor that only claims to live on a device (no data): enough for device discovery."""

    @staticmethod
    def __new__(cls, device: str) -> OnDevice:
        return torch.Tensor._make_wrapper_subclass(cls, (2,), dtype=torch.float32, device=torch.device(device))  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"{func} on a fake device")


@pytest.fixture
def fake_devices(monkeypatch: pytest.MonkeyPatch) -> dict[str, FakeGenerator]:
    """Two fake accelerator types, `xpu` and `hpu`, served by `torch.get_device_module`."""
    fakes = {"xpu": FakeGenerator(), "hpu": FakeGenerator()}
    real = torch.get_device_module

    def get_device_module(device: Any = None) -> Any:
        kind = torch.device(device).type if not isinstance(device, str) or ":" in device else device
        if kind in fakes:
            return fakes[kind]
        return real(device)

    monkeypatch.setattr(torch, "get_device_module", get_device_module)
    monkeypatch.setattr(_rng, "_built_accelerator", lambda: torch.device("xpu"))  # a build with an accelerator
    return fakes


def test_devices_come_from_positional_keyword_and_module_tensors(fake_devices: dict[str, FakeGenerator]) -> None:
    module = nn.Linear(2, 2)
    module.register_buffer("on_hpu", OnDevice("hpu"))
    found = _rng.devices_of([randn(2), OnDevice("xpu:1"), OnDevice("xpu:1")], module)
    assert found == (torch.device("hpu", 0), torch.device("xpu", 1))
    assert _rng.devices_of([randn(2)]) == ()


def test_without_an_accelerator_module_tensors_are_not_walked(fake_devices: dict[str, FakeGenerator],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without an accelerator has no parameter on a device with a generator: the walk is skipped."""
    module = nn.Linear(2, 2)
    module.register_buffer("on_hpu", OnDevice("hpu"))
    monkeypatch.setattr(_rng, "_built_accelerator", lambda: None)
    assert _rng.devices_of([randn(2), OnDevice("xpu:1")], module) == (torch.device("xpu", 1),)


def test_rng_of_every_fake_device_is_stashed_and_restored_in_a_fork(
    fake_devices: dict[str, FakeGenerator],
) -> None:
    """Forward draws on two device types (one passed as a keyword); recompute sees forward's states."""
    xpu, hpu = fake_devices["xpu"], fake_devices["hpu"]
    seen: list[tuple[int, int]] = []

    def fn(x: torch.Tensor, on_xpu: torch.Tensor, *, on_hpu: torch.Tensor) -> torch.Tensor:
        seen.append((xpu.draw(1), hpu.draw(0)))
        return x.sin().exp()

    x = randn(4, requires_grad=True)
    y = remat.remat(fn)(x, OnDevice("xpu:1"), on_hpu=OnDevice("hpu"))
    after_forward = (dict(xpu.state), dict(hpu.state))
    xpu.draw(1)  # the user draws between forward and backward
    y.sum().backward()
    assert seen == [(100, 0), (100, 0)], "recompute must see the states forward saw"
    assert (xpu.state, hpu.state) == ({1: after_forward[0][1] + 1}, after_forward[1])  # the user's stream
    assert ("set", 1, 100) in xpu.calls and ("set", 0, 0) in hpu.calls
    assert xpu.calls[-1] == ("set", 1, 102) and hpu.calls[-1] == ("set", 0, 1)  # restored after the fork


def test_every_index_of_the_accelerator_counts_once_it_is_initialised(fake_devices: dict[str, FakeGenerator]) -> None:
    """A function may reach any index through a closure; before the accelerator is initialised, nothing is asked
    of it (no cost where only the CPU is in use)."""
    xpu = fake_devices["xpu"]
    assert _rng.devices_of([randn(2)]) == ()
    assert xpu.calls == []
    xpu.initialized, xpu.count = True, 3
    assert _rng.devices_of([randn(2)]) == tuple(torch.device("xpu", i) for i in range(3))
    assert _rng.devices_of([randn(2), OnDevice("hpu")]) == (
        torch.device("hpu", 0), *(torch.device("xpu", i) for i in range(3)))

    seen: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:  # draws on xpu:2, which no input shows
        seen.append(xpu.draw(2))
        return x.sin().exp()

    remat.remat(fn)(randn(4, requires_grad=True)).sum().backward()
    assert seen == [200, 200], "recompute must see the state forward saw"
    assert xpu.state[2] == 201, "the caller's stream after backward is as without remat"


def test_no_device_rng_is_touched_without_preserve_rng(fake_devices: dict[str, FakeGenerator]) -> None:
    fn = remat.remat(preserve_rng=False)(lambda x, d: x.sin().exp())
    fn(randn(4, requires_grad=True), OnDevice("xpu:0")).sum().backward()
    assert fake_devices["xpu"].calls == []


def test_rng_stash_restores_cpu_inside_a_fork() -> None:
    torch.manual_seed(3)
    stash = _rng.RngStash.capture(())
    first = torch.rand(3)
    with stash.restore():
        again = torch.rand(3)
    after = torch.rand(3)
    torch.manual_seed(3)
    torch.rand(3)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(after, torch.rand(3), rtol=0, atol=0)


# -- on a device (CUDA where there is a GPU, and the device written in Python: the `accelerator` fixture) -------


def _device_run(
    fn: Callable[..., torch.Tensor], x: torch.Tensor, extra: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    x = x.detach().clone().requires_grad_()
    fn(x, scale=extra).sum().backward()
    assert x.grad is not None
    return x.grad, torch.get_device_module(extra.device.type).get_rng_state(extra.device), torch.get_rng_state()


def _dropout_on_device(x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
    here = F.dropout(x.to(scale.device).sin(), 0.5).exp() * scale
    return here.cpu() + F.dropout(x, 0.5)


@pytest.mark.equivalence
def test_device_dropout_with_a_keyword_tensor_on_the_device_matches_baseline(accelerator: str) -> None:
    """The input is on the CPU; the device is reached only through a keyword tensor, which must count."""
    x, scale = randn(32), randn(32, seed=1).to(accelerator)
    before = recomputes()
    ours = _device_run(remat.remat(_dropout_on_device), x, scale)
    assert recomputes() > before
    base = _device_run(_dropout_on_device, x, scale)
    for expected, got in zip(base, ours, strict=True):
        torch.testing.assert_close(got.cpu(), expected.cpu(), rtol=0, atol=0)


@pytest.mark.equivalence
def test_transformer_on_a_device_matches_baseline(accelerator: str) -> None:
    torch.manual_seed(0)
    model = TransformerBlock().double().to(accelerator)
    x = randn(2, 5, 8).to(accelerator).requires_grad_()
    module = torch.get_device_module(accelerator)
    results = []
    before = recomputes()
    for block in (model, remat.remat(__import__("copy").deepcopy(model))):
        torch.manual_seed(1)
        xi = x.detach().clone().requires_grad_()
        block(xi).sum().backward()
        results.append((xi.grad, *[p.grad for p in block.parameters()], module.get_rng_state()))
    assert recomputes() > before
    for expected, got in zip(*results, strict=True):
        torch.testing.assert_close(got.cpu(), expected.cpu())
