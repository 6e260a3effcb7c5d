"""Tests for remat._measure.track: live storage bytes per device, through a dispatch mode and finalizers."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from remat._engine import modes as _modes
from remat._measure.track import Tracker, track
from remat._measure.track import _TrackingMode as _TrackMode

F32 = 4


def _dispatch_modes() -> int:
    return int(torch._C._len_torch_dispatch_stack())


def test_known_allocations_give_known_bytes() -> None:
    with track() as t:
        a = torch.empty(1000)
        b = torch.ones(10, 10, dtype=torch.float64)
        c = torch.zeros(3, dtype=torch.int8)
        assert t.current_bytes == 1000 * F32 + 100 * 8 + 3
    assert t.peak_bytes == 4803
    assert (a.numel(), b.numel(), c.numel()) == (1000, 100, 3)


def test_views_share_their_base_storage() -> None:
    with track() as t:
        x = torch.empty(100)
        views = [x.view(10, 10), x.view(10, 10).t(), x[::2], x[5:], x.unsqueeze(0), *torch.split(x, 10)]
        assert t.current_bytes == 100 * F32
        del x
        assert t.current_bytes == 100 * F32, "a view keeps its base's storage alive"
        del views
        assert t.current_bytes == 0
    assert t.peak_bytes == 100 * F32


def test_freed_storages_are_subtracted_and_peak_stays() -> None:
    with track() as t:
        a = torch.empty(1000)
        b = torch.empty(500)
        del a
        assert t.current_bytes == 500 * F32
        c = torch.empty(100)
        assert t.current_bytes == 600 * F32
        del b, c
    assert t.current_bytes == 0
    assert t.peak_bytes == 1500 * F32


def test_temporaries_count_toward_peak() -> None:
    x = torch.ones(1000)
    with track() as t:
        y = (x * 2 + 1).sum()  # x * 2 and (+ 1) are temporaries of 4000 bytes each
    assert t.current_bytes == y.nbytes == F32
    assert t.peak_bytes == 2 * 1000 * F32


def test_tensors_from_before_the_block_are_not_counted() -> None:
    x = torch.ones(1000)
    keep = x.view(10, 100)
    with track() as t:
        x.add_(1)  # in place: same storage
        v = x[:10]  # a view of an outside storage
        torch.add(x, 1, out=keep.view(-1))  # out= into an outside storage, same size
        del x  # freeing an outside tensor does not go below zero
    assert (t.current_bytes, t.peak_bytes) == (0, 0)
    assert v.shape == (10,)


def test_storage_held_only_by_autograd_is_counted_until_backward_frees_it() -> None:
    w = torch.randn(1000, requires_grad=True)
    with track() as t:
        h = w * 2
        out = h.sin()  # saves h for backward
        del h
        held = t.current_bytes
        torch.autograd.backward(out.sum())
        after = t.current_bytes
    assert held == 2 * 1000 * F32  # h (saved) + out
    # h is freed by backward; out, the loss, and w.grad remain.
    assert w.grad is not None
    assert after == out.nbytes + w.grad.nbytes


def test_backward_inside_the_block_is_tracked() -> None:
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(64, 256)
    with track() as t:
        loss = (x @ w).relu().sum()
        before_backward = t.current_bytes
        torch.autograd.backward(loss)
        assert w.grad is not None
        assert t.bytes_of([w.grad]) == {torch.device("cpu"): w.grad.nbytes}
    assert t.peak_bytes > before_backward + w.grad.nbytes - 1
    assert t.current_bytes == loss.nbytes + w.grad.nbytes


def test_nested_trackers_see_their_own_window() -> None:
    with track() as outer:
        a = torch.empty(1000)
        with track() as inner:
            b = torch.empty(200)
            c = a[:10]  # a view of a storage from before the inner block
            del a  # freed inside, allocated outside the inner block
            assert inner.current_bytes == 200 * F32
        assert outer.current_bytes == 1200 * F32
        del c
        assert outer.current_bytes == 200 * F32
    assert (inner.peak_bytes, inner.current_bytes) == (200 * F32, 200 * F32)
    assert (outer.peak_bytes, outer.current_bytes) == (1200 * F32, 200 * F32)
    assert b.numel() == 200


def test_numbers_are_frozen_after_the_block() -> None:
    with track() as t:
        a = torch.empty(1000)
    del a
    b = torch.empty(1000)
    assert (t.current_bytes, t.peak_bytes) == (1000 * F32, 1000 * F32)
    assert b.numel() == 1000


def test_resized_storages_are_recounted() -> None:
    with track() as t:
        out = torch.empty(0)
        torch.add(torch.ones(10), 1, out=out)  # resizes out to 40 bytes; the ones are freed
        assert t.current_bytes == 10 * F32
        out.resize_(100)
        assert t.current_bytes == 100 * F32
    assert t.peak_bytes == 100 * F32


def test_tensor_from_python_data_is_counted() -> None:
    with track() as t:
        x = torch.tensor([1.0, 2.0, 3.0])
    assert t.current_bytes == 3 * F32
    assert x.sum().item() == 6.0


def test_multiple_outputs_are_each_counted_once() -> None:
    x = torch.randn(10, 20)
    with track() as t:
        values, indices = x.max(dim=1)
        halves = x.chunk(2)  # views of x: nothing new
    assert t.current_bytes == 10 * F32 + 10 * 8
    assert len(halves) == 2 and values.shape == indices.shape


def test_per_device_queries() -> None:
    with track() as t:
        a = torch.empty(10)
        m = torch.empty(1000, device="meta")  # no memory
    assert t.devices == (torch.device("cpu"),)
    assert t.peak("cpu") == t.current(torch.device("cpu")) == 10 * F32
    assert t.peak("cuda") == t.current("cuda:1") == 0
    assert "current_bytes=40" in repr(t)
    assert a.numel() == 10 and m.numel() == 1000


def test_tracker_enters_once_and_leaves_no_mode_behind() -> None:
    assert _dispatch_modes() == 0
    tracker = track()
    assert isinstance(tracker, Tracker)
    with pytest.raises(ZeroDivisionError), tracker:
        torch.ones(3)
        raise ZeroDivisionError
    assert _dispatch_modes() == 0
    with pytest.raises(RuntimeError, match=r"^remat: a Tracker can be entered only once"):
        tracker.__enter__()
    assert tracker.current_bytes == 0


def test_frees_from_another_thread_are_subtracted() -> None:
    box: list[torch.Tensor] = []
    with track() as t:
        box.append(torch.empty(1000))
        thread = threading.Thread(target=box.clear)
        thread.start()
        thread.join()
        assert t.current_bytes == 0
    assert t.peak_bytes == 1000 * F32


_STEP = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 64), st.sampled_from([torch.float32, torch.float64, torch.int8])),
    st.tuples(st.just("view"), st.integers(0, 1000), st.just(None)),
    st.tuples(st.just("del"), st.integers(0, 1000), st.just(None)),
    st.tuples(st.just("inplace"), st.integers(0, 1000), st.just(None)),
    st.tuples(st.just("add"), st.integers(0, 1000), st.just(None)),
)


def test_fake_tensors_count_apart_from_the_totals() -> None:
    """Fake tensors' storages live on ``meta``, which holds no memory: shown per device, never in the totals."""
    from torch._subclasses import FakeTensorMode

    with track() as t:
        real = torch.empty(10)
        with FakeTensorMode():
            fake = torch.empty(1000)  # claims the CPU; its storage is on meta
        assert t.current_bytes == 10 * F32 and t.current("meta") == 1000 * F32
    assert t.peak_bytes == 10 * F32 and t.peak("meta") == 1000 * F32
    assert torch.device("meta") in t.devices and real.numel() + fake.numel() == 1010


def test_counting_fake_tensors_asks_their_mode_for_no_device() -> None:
    """A fake tensor's `is_meta` dispatches `prim.device` through every mode: the tracker reads its `device` instead,
    and a tracker that counts bytes only (`_sees_devices=False`, the estimate's) is not shown `prim.device` at all;
    the bytes are the same."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from remat._measure.fake import FakeTracker, fake_mode

    class Devices(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.asked = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.asked += func is torch.ops.prim.device.default
            return func(*args, **(kwargs or {}))

    class Seen(FakeTracker):
        def __init__(self) -> None:
            super().__init__()
            self.devices_seen = 0

        def _see(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
            self.devices_seen += func is torch.ops.prim.device.default
            super()._see(func, args, kwargs, out)

    class BytesOnly(Seen):
        _sees_devices = False

    def run() -> None:
        w = torch.empty(64, 64, requires_grad=True)
        (w * w).view(-1).sum().backward()  # a view asks for the device; so does autograd

    with fake_mode():
        with Devices() as bare:
            run()
        found = []
        for tracker in (Seen(), BytesOnly()):
            with Devices() as devices, tracker:
                run()
            found.append((devices.asked, tracker.devices_seen, tracker.peak("cpu")))
    (asked, seen, peak), (asked_too, none_seen, same_peak) = found
    assert asked == asked_too == bare.asked > 0, found  # the trackers ask for no device of their own
    assert seen > 0 and none_seen == 0 and peak == same_peak > 0, found


def test_a_budget_planned_under_a_tracker_reads_what_it_allocated() -> None:
    """`apply(budget=...)` plans on a fake twin: a user's tracker around it reads the real bytes, within the
    budget (`docs/guides/budget.md`), not the twin's storages."""
    pytest.importorskip("transformers")
    import remat
    from tests.models import build

    work = build("bert")
    with track() as t:
        remat.apply(work.model, budget=0.6, sample=work.sample, loss=work.loss)
    plan = remat.plan(work.model).budget
    assert plan is not None
    assert t.peak("meta") > plan.budget  # the twin's step was seen, on meta
    assert t.peak_bytes == t.peak("cpu") <= plan.budget


@settings(max_examples=60, deadline=None)
@given(st.lists(_STEP, max_size=25))
def test_current_bytes_equal_the_live_distinct_storages(steps: list[tuple[str, int, torch.dtype | None]]) -> None:
    live: list[torch.Tensor] = []
    peak = 0

    def expected() -> int:
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in live}
        return sum(storages.values())

    with track() as t:
        for kind, n, dtype in steps:
            if kind == "alloc":
                assert dtype is not None
                live.append(torch.zeros(n, dtype=dtype))
            elif live and kind == "view":
                live.append(live[n % len(live)][1:])
            elif live and kind == "del":
                live.pop(n % len(live))
            elif live and kind == "inplace":
                live[n % len(live)].mul_(2)
            elif live and kind == "add":
                live.append(live[n % len(live)] + 1)
            peak = max(peak, expected())
            assert t.current_bytes == expected()
    assert t.peak_bytes >= peak


@pytest.mark.parametrize("index", [0, 1])
def test_a_device_counts_what_the_cpu_counts(test_device: str, index: int) -> None:
    """The tracker on a device that is not the CPU (tests/pydevice.py): bytes are counted on that device and
    index, and a step counts there exactly what it counts on the CPU."""

    def step(device: torch.device) -> tuple[tuple[torch.device, ...], int, int]:
        generator = torch.Generator().manual_seed(0)
        w = torch.randn(64, 64, generator=generator).to(device).requires_grad_()
        x = torch.randn(32, 64, generator=generator).to(device)
        with track() as t:
            loss = (x @ w).relu().square().sum()
            torch.autograd.backward(loss)
            del loss
        return t.devices, t.peak(device), t.current(device)

    device = torch.device(test_device, index)
    on_cpu, here = step(torch.device("cpu")), step(device)
    assert here[0] == (device,)
    assert here[1:] == on_cpu[1:] and here[1] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_matches_the_allocator() -> None:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    x = torch.randn(512, 1024, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with track() as t:
        loss = (x @ w).relu().square().sum()
        torch.autograd.backward(loss)
        torch.cuda.synchronize()
    allocator_peak = torch.cuda.max_memory_allocated() - base
    assert t.devices == (torch.device("cuda", 0),)
    # The caching allocator rounds every block up to 512 bytes and may hold workspaces (cuBLAS).
    assert t.peak("cuda") <= allocator_peak
    assert allocator_peak - t.peak("cuda") <= 0.05 * allocator_peak + 8 * 1024 * 1024


@pytest.mark.parametrize("switch", [True, False], ids=["switch", "torch's guard"])
def test_compiled_code_runs_under_the_tracker(monkeypatch: pytest.MonkeyPatch, switch: bool) -> None:
    import torch._dynamo

    # See NOTE [ Modes without the dynamo guard ]: guarded while compiled code runs, by the switch, or (a torch
    # without the switch's parts) by torch's guard on every op.
    monkeypatch.setattr(_TrackMode, "_twin", None)
    if not switch:
        monkeypatch.setattr(_modes, "_switching", lambda raw: None)
    compiled = torch.compile(lambda a: (a * 2).sin(), backend="eager")
    x = torch.ones(100)
    with track() as t:
        assert t._mode is not None and t._mode._guarded and t._mode._torch_guard is not switch
        y = compiled(x)
    assert t.current_bytes == y.nbytes == 100 * F32
    assert t.peak_bytes == 2 * 100 * F32
    torch._dynamo.reset()


def test_a_bytes_only_tracker_answers_a_fake_tensors_device_itself() -> None:
    """NOTE [ A fake tensor's device ]: the fake mode is not asked, the answer is its own, and a mode below the
    tracker's still sees every query."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from remat._measure.fake import FakeTracker

    asked: list[str] = []

    class BytesOnly(FakeTracker):  # as the estimate's tracker counts
        _sees_devices = False

    class Counting(FakeTensorMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.prim.device.default:
                asked.append("fake")
            return super().__torch_dispatch__(func, types, args, kwargs or {})

    class Below(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.prim.device.default:
                asked.append("below")
            return func(*args, **(kwargs or {}))

    def step() -> torch.device:
        w = torch.randn(64, 64, requires_grad=True)
        (w @ w).sin().sum().backward()
        return w.grad.device if w.grad is not None else torch.device("meta")

    with Counting(allow_non_fake_inputs=True):
        with BytesOnly() as tracker:
            assert step() == torch.device("cpu")
        assert asked == [] and tracker.peak("cpu") > 0, asked
        with Below(), BytesOnly():
            step()
        assert asked and set(asked) == {"below", "fake"}, asked
        asked.clear()
        with FakeTracker():  # one that sees devices (a profile prices each op) passes every query on
            step()
        assert asked, "the fake mode was asked"
