"""`remat.track(limit=...)`: a device of a given size on CPU (NOTE [ A device's limit ] in remat/_measure/track.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import remat
from tests.conftest import assert_same_grads, dispatch_modes

F32 = 4


def _no_tracker_left() -> None:
    assert dispatch_modes() == 0, "a dispatch mode was left on the stack"
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_, "the storage resize wrapper was left installed"


def test_allocations_within_the_limit_pass_and_the_peak_is_the_trackers() -> None:
    with remat.track(limit=4000) as t:
        a = torch.empty(500)
        b = torch.empty(500)  # exactly 4000 bytes: a limit is the most allowed, not a bound to stay under
        del a, b
        c = torch.empty(1000)
    assert (t.peak_bytes, t.current_bytes) == (1000 * F32, 1000 * F32)
    assert c.numel() == 1000


def test_the_allocation_that_crosses_raises_out_of_memory_naming_limit_live_and_op() -> None:
    x = torch.ones(100, 10)  # live before the block: not counted
    with remat.track(limit=1000) as t:
        y = x[:20] * 2  # 800 bytes
        with pytest.raises(torch.OutOfMemoryError) as caught:
            y @ torch.ones(10, 10)  # the ones (400 bytes) cross: 800 + 400 > 1000
        assert t.current_bytes == 800, "the refused storage is not counted"
    message = str(caught.value)
    assert message.startswith("remat: out of memory on cpu")
    assert "aten.ones.default" in message
    assert "(1000 bytes)" in message  # the limit
    assert "(800 bytes) live" in message
    assert "(400 bytes)" in message  # what the op tried to allocate
    assert isinstance(caught.value, RuntimeError)  # torch.OutOfMemoryError is one, as on a GPU
    assert t.peak_bytes == 800
    assert y.shape == (20, 10)
    _no_tracker_left()


def test_out_of_memory_in_backward_names_the_backward_op() -> None:
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    with remat.track() as probe:
        (x @ w).tanh().sum().backward()
    forward_and_backward = probe.peak_bytes
    w.grad = None
    with pytest.raises(torch.OutOfMemoryError, match=r"^remat: out of memory on cpu .*aten\."), \
            remat.track(limit=forward_and_backward - 1):
        loss = (x @ w).tanh().sum()
        loss.backward()
    _no_tracker_left()


@pytest.mark.parametrize(
    ("limit", "nbytes"),
    [("4KiB", 4096), ("4 KB", 4000), ("0.5MiB", 2**19), ("1e3", 1000), (4096, 4096)],
)
def test_limits_are_read_as_remat_reads_sizes(limit: int | str, nbytes: int) -> None:
    with remat.track(limit=limit):
        fits = torch.empty(nbytes, dtype=torch.int8)
        with pytest.raises(torch.OutOfMemoryError, match=rf"limit of .*\({nbytes} bytes\)"):
            torch.empty(1, dtype=torch.int8)
    assert fits.numel() == nbytes


@pytest.mark.parametrize(
    ("limit", "error", "words"),
    [
        (0.5, TypeError, r"^remat: track's `limit` is a device's memory in bytes"),
        (True, TypeError, r"^remat: track's `limit`"),
        ("80 parsecs", ValueError, r"^remat: track's `limit` .*'80 parsecs'"),
        (0, ValueError, r"^remat: track's `limit`"),
        ({"cpu": -1}, ValueError, r"^remat: track's `limit\['cpu'\]`"),
        ({3: 100}, TypeError, r"^remat: track's `limit` maps devices to bytes, but got the key 3"),
    ],
)
def test_a_limit_that_cannot_be_read_is_refused_when_tracking_is_set_up(
    limit: object, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        remat.track(limit=limit)  # type: ignore[arg-type]
    _no_tracker_left()


def test_a_limit_per_device_limits_only_the_devices_it_names() -> None:
    with remat.track(limit={"cuda": 10}) as t:  # each CUDA device: CPU is not limited
        big = torch.empty(1000)
    assert t.peak("cpu") == 1000 * F32
    with remat.track(limit={torch.device("cpu"): "1KiB"}), pytest.raises(torch.OutOfMemoryError):
        torch.empty(1000)
    assert big.numel() == 1000


def test_meta_storages_are_not_limited_unless_named() -> None:
    with remat.track(limit=16) as t:
        m = torch.empty(10**6, device="meta")  # no storage the tracker counts
    assert t.peak_bytes == 0
    assert m.numel() == 10**6


def test_storages_grown_by_resize_are_refused_before_they_grow() -> None:
    """FSDP2 allocates unsharded parameters with ``untyped_storage().resize_``: the limit sees it first."""
    x = torch.empty(100)
    x.untyped_storage().resize_(0)  # freed before the block, as FSDP2 frees a parameter after forward
    with remat.track(limit=600) as t:
        with pytest.raises(torch.OutOfMemoryError, match=r"UntypedStorage\.resize_ tried to allocate .*\(800 bytes\)"):
            x.untyped_storage().resize_(800)
        assert x.untyped_storage().nbytes() == 0, "the storage must not grow when the limit refuses it"
        x.untyped_storage().resize_(400)  # fits: counted from now on
        assert t.current_bytes == 400
        y = torch.empty(50)  # 200 bytes: 600 live
        with pytest.raises(torch.OutOfMemoryError):  # a counted storage growing past the limit is refused too
            y.untyped_storage().resize_(800)
        assert y.untyped_storage().nbytes() == 200
        x.untyped_storage().resize_(0)  # as FSDP2 frees it after forward
        assert t.current_bytes == 200
    assert t.peak_bytes == 600
    _no_tracker_left()


def test_the_raise_leaves_no_mode_behind_and_tracking_and_training_go_on() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 32)
    with pytest.raises(torch.OutOfMemoryError), remat.track(limit=2048):
        model(x).square().mean().backward()
    _no_tracker_left()
    optimizer.zero_grad()
    with remat.track() as t:  # a later tracker works and sees a whole step
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
    assert t.peak_bytes > 2048
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    _no_tracker_left()


def test_an_inner_limit_leaves_an_outer_tracker_counting_right() -> None:
    with remat.track() as outer:
        a = torch.empty(100)
        with pytest.raises(torch.OutOfMemoryError), remat.track(limit=100):
            torch.empty(1000)  # counted by the outer tracker, then dropped with the raise
        assert outer.current_bytes == 100 * F32
    assert outer.peak_bytes == 1100 * F32  # the allocation happened (CPU memory); only the inner one refused it
    assert a.numel() == 100
    _no_tracker_left()


def _adamw_loop(steps: int = 3) -> Callable[[], None]:
    """A small MLP, AdamW and its data, made before the loop as a user makes them; the loop zeroes gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randn(32, 8)

    def loop() -> None:
        for _ in range(steps):
            optimizer.zero_grad()  # gradients set to None: every backward allocates them
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()

    return loop


def test_a_training_loop_fits_in_its_measured_peak_and_not_in_less() -> None:
    with remat.track() as measured:
        _adamw_loop()()
    peak = measured.peak("cpu")
    assert peak > 0
    with remat.track(limit=peak) as t:
        _adamw_loop()()  # the same loop from the same state: the same allocations
    assert t.peak("cpu") == peak
    lower = int(peak * 0.9)
    with pytest.raises(torch.OutOfMemoryError, match=rf"limit of .*\({lower} bytes\)"), remat.track(limit=lower):
        _adamw_loop()()
    _no_tracker_left()


@pytest.mark.equivalence
def test_remat_fits_a_step_that_does_not_fit_without_it() -> None:
    """The dry run the limit exists for: a limit below the step's peak without remat, met with full remat."""
    def make() -> nn.Module:
        return nn.Sequential(*(nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)) for _ in range(8)))

    x = torch.randn(256, 64, dtype=torch.float64)

    def step(model: nn.Module) -> None:
        model(x).square().sum().backward()

    plain = make().double()
    with remat.track() as without:
        step(plain)
    full = remat.apply(make().double())
    with remat.track() as with_remat:
        step(full)
    limit = (without.peak_bytes + with_remat.peak_bytes) // 2
    assert with_remat.peak_bytes < limit < without.peak_bytes
    with pytest.raises(torch.OutOfMemoryError), remat.track(limit=limit):
        step(make().double())
    assert_same_grads(make, (x,), lambda m: remat.apply(m))
    full.zero_grad(set_to_none=True)
    with remat.track(limit=limit):
        step(full)
    _no_tracker_left()
