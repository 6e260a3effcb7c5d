"""Offload to host memory (docs/guides/offload.md): `remat.offload()`, `offload=` on sites, `policies.offload`.

On CPU everything runs through `remat.offload(include_cpu=True)`, which copies CPU tensors into separate host
tensors through the same code as on an accelerator (torch.cpu's streams are no-ops, its events None). The
`cuda`-marked tests at the end check what only a GPU can show: the side stream, no device synchronize, and no
use of freed device memory.
"""

from __future__ import annotations

import copy
import gc
import pickle
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import pytest
import torch
from conftest import assert_same_grads, randn
from models import MLP, ConvBN, TransformerBlock
from torch import nn

import remat
from remat import policies
from remat._chain.chain import chain
from remat._engine import offload as _offload
from remat._engine import transfer as _transfer

# Tiny test tensors are far below the default floor of 1 KiB: offload every tensor unless a test says otherwise.
CPU = remat.offload(min_bytes=0, include_cpu=True)


def SITE_PACE() -> AbstractContextManager[Any]:
    """CPU's hooks as a site uses them (`Offload.hooks`): every copy of the site's pace, which may stay in flight and
    come back ahead of its use (NOTE [ Offload lifecycle ], rule 6), where `with CPU:` gives the block's pace."""
    return torch.autograd.graph.saved_tensors_hooks(*CPU.hooks)


class Copies:
    """Every copy to host (`out`: the saved tensor's shape, the host copy's id) and back (`back`: host copy ids)."""

    def __init__(self) -> None:
        self.out: list[tuple[tuple[int, ...], int]] = []
        self.back: list[int] = []
        self.parcels: list[weakref.ref[_transfer._Copy]] = []  # every host copy made
        self.brought: list[weakref.ref[torch.Tensor]] = []  # every tensor brought back
        self.storages: dict[int, set[int]] = {}  # the storage of every tensor packed -> the copies its parcels use


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[Copies]:
    seen = Copies()
    pack, back, init = _transfer.pack, _transfer._Lane.back, _transfer._Copy.__init__

    def spy_pack(tensor: torch.Tensor, pin: bool, shared: Any, *pace: bool) -> _transfer.Parcel:
        made = len(seen.parcels)
        parcel = pack(tensor, pin, shared, *pace)
        seen.storages.setdefault(id(tensor.untyped_storage()), set()).add(id(parcel.copy))
        if len(seen.parcels) > made:  # a new host copy, not a place in one made before
            seen.out.append((tuple(tensor.shape), id(parcel.copy.host)))
        return parcel

    def spy_back(lane: Any, host: torch.Tensor, pinned: bool) -> tuple[torch.Tensor, Any, Any]:
        seen.back.append(id(host))
        tensor, event, stream = back(lane, host, pinned)
        seen.brought.append(weakref.ref(tensor))
        return tensor, event, stream

    def spy_init(copy: _transfer._Copy, *args: Any) -> None:
        init(copy, *args)
        seen.parcels.append(weakref.ref(copy))

    monkeypatch.setattr(_offload, "pack", spy_pack)
    monkeypatch.setattr(_transfer._Copy, "__init__", spy_init)
    monkeypatch.setattr(_transfer._Lane, "back", spy_back)
    yield seen


@pytest.fixture(autouse=True)
def _nothing_left_on_the_host() -> Iterator[None]:
    """After every test here: no host copy alive (the graphs of the test are gone)."""
    yield
    gc.collect()
    assert _transfer.live_parcels() == 0, "a host copy outlived its graph"
    assert _transfer.offloaded_bytes()[0] == 0


def in_context(offload: AbstractContextManager[Any]) -> Callable[[Any], Callable[..., Any]]:
    """A variant for `assert_same_grads`: call the target inside the offload block."""

    def variant(target: Any) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with offload:
                return target(*args, **kwargs)

        return call

    return variant


def chain_of_sines(x: torch.Tensor, n: int = 6) -> torch.Tensor:
    for _ in range(n):
        x = x.sin()
    return x


# -- remat.offload() ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [MLP, TransformerBlock, ConvBN], ids=["mlp", "transformer", "conv_bn"])
def test_offload_gives_the_gradients_of_no_remat(make: Callable[[], nn.Module], copies: Copies) -> None:
    shape = (2, 3, 6, 6) if make is ConvBN else (2, 5, 8) if make is TransformerBlock else (4, 8)
    assert_same_grads(make, (randn(*shape, requires_grad=True),), in_context(CPU), expect_recompute=False)
    assert copies.out, "nothing was offloaded"
    assert sorted(copies.back) == sorted(host for _, host in copies.out), "a copy came back twice, or never"


def test_offloaded_tensors_leave_in_forward_and_come_back_in_backward(copies: Copies) -> None:
    x = randn(16, 16, requires_grad=True)
    with CPU:
        h = (x * 2).exp()  # exp saves its output
        storage = weakref.ref(h.untyped_storage())
        y = h.sin().sum()
    del h
    gc.collect()
    assert storage() is None, "the device tensor was not freed once copied"
    assert _transfer.live_parcels() == 1 and _transfer.offloaded_bytes()[0] == 16 * 16 * 8  # exp and sin share h
    y.backward()
    assert len(copies.back) == len(copies.out)
    assert _transfer.live_parcels() == 0 and _transfer.offloaded_bytes()[0] == 0


def test_without_offload_the_same_tensor_stays() -> None:
    # The baseline of the test above: autograd keeps the tensor itself.
    x = randn(16, 16, requires_grad=True)
    h = (x * 2).exp()
    storage = weakref.ref(h.untyped_storage())
    y = h.sin().sum()
    del h
    gc.collect()
    assert storage() is not None
    y.backward()


def test_a_tensor_saved_twice_is_copied_once(copies: Copies) -> None:
    x = randn(8, 8, requires_grad=True)
    with CPU:
        h = x.tanh()  # saved by tanh (its output) and by mm (its input): one object
        y = (h @ h).sum()
    assert [shape for shape, _ in copies.out].count((8, 8)) == 1
    y.backward()


def test_parameters_buffers_views_and_small_tensors_stay(copies: Copies) -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(32, 32).double()
            self.register_buffer("scale", torch.rand(32, 32, dtype=torch.float64) + 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.linear(x) * self.scale).tanh()

    module = Scaled()
    x = randn(32, 32)
    small = randn(2, 2, requires_grad=True)
    with remat.offload(min_bytes=1024, include_cpu=True) as offload:
        y = module(x).sum() + (small * small).sum()
        assert not offload.qualifies(module.linear.weight)
        assert not offload.qualifies(module.linear.weight.t())
        assert not offload.qualifies(module.scale)
        assert not offload.qualifies(small * 2)
        assert offload.qualifies(x)
    offloaded = sorted(shape for shape, _ in copies.out)
    # x (saved by addmm) and the tanh output; not the weight, its transpose, the buffer (saved by mul), nor
    # the 2x2 tensors.
    assert offloaded == [(32, 32)] * 2
    y.backward()
    assert module.linear.weight.grad is not None


def test_cpu_tensors_pass_through_by_default(copies: Copies) -> None:
    x = randn(64, 64, requires_grad=True)
    with remat.offload():
        y = x.exp().exp().sum()
    y.backward()
    assert copies.out == [] and copies.back == []


def test_an_inplace_change_of_a_tensor_kept_on_the_device_raises() -> None:
    w = randn(4, 4, requires_grad=True)
    with CPU:
        y = (w * w).sum()  # w is a leaf that requires grad: kept as it is
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(remat.RematError, match="modified by an inplace operation"):
        y.backward()


def test_retain_graph_twice(copies: Copies) -> None:
    x = randn(8, 8, requires_grad=True)
    with CPU:
        y = chain_of_sines(x).sum()
    once = len(copies.out)
    y.backward(retain_graph=True)
    first = x.grad.clone()
    assert _transfer.live_parcels() == once, "retain_graph must keep the host copies"
    y.backward()
    torch.testing.assert_close(x.grad, 2 * first)
    assert len(copies.back) == 2 * once
    del y
    assert _transfer.live_parcels() == 0


def test_create_graph_double_backward() -> None:
    def second(x: torch.Tensor, offload: AbstractContextManager[Any]) -> torch.Tensor:
        x = x.detach().clone().requires_grad_()
        with offload:
            y = (chain_of_sines(x, 3) * x).sum()
        (grad,) = torch.autograd.grad(y, x, create_graph=True)
        (grad * grad).sum().backward()
        assert x.grad is not None
        return x.grad

    x = randn(5, 5)
    torch.testing.assert_close(second(x, CPU), second(x, nullcontext()))


def test_dropping_the_graph_without_backward_frees_every_host_copy() -> None:
    x = randn(16, 16, requires_grad=True)
    with CPU:
        y = chain_of_sines(x)
    assert _transfer.live_parcels() > 0
    del y
    assert _transfer.live_parcels() == 0  # no cycle: freed without gc


def test_an_exception_inside_leaves_nothing_behind() -> None:
    x = randn(16, 16, requires_grad=True)
    with pytest.raises(ZeroDivisionError), CPU:
        y = chain_of_sines(x)
        raise ZeroDivisionError
    del y
    gc.collect()
    assert _transfer.live_parcels() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert_same_grads(
        lambda: chain_of_sines, (randn(4, 4, requires_grad=True),), in_context(CPU), expect_recompute=False
    )


def test_backward_brings_tensors_back_in_reverse_order_each_once(copies: Copies) -> None:
    x = randn(8, 8, requires_grad=True)
    with CPU:
        y = chain_of_sines(x, 8).sum()
    packed = [host for _, host in copies.out]
    y.backward()
    assert sorted(copies.back) == sorted(packed), "a tensor was brought back twice, or never"
    assert copies.back == packed[::-1], "backward did not fetch in reverse order of packing"
    assert all(ref() is None for ref in copies.brought), "a tensor brought back outlived its use"


@pytest.mark.parametrize(
    "variant",
    [
        lambda m: in_context(SITE_PACE())(m),
        lambda m: remat.apply(m, offload=CPU),
        lambda m: remat.apply(m, offload=CPU, policy=policies.save_matmuls),  # type: ignore[arg-type]
        lambda m: in_context(CPU)(remat.apply(m)),  # the blocks hand their inputs to the block: the site's pace
    ],
    ids=["site_pace", "per_block", "per_block_save_matmuls", "per_block_inside_offload"],
)
def test_backward_waits_only_for_its_first_copy_the_others_come_ahead(
    variant: Callable[[nn.Module], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Autograd unpacks in reverse order of packing, a site's recompute asks for what its policy kept in the
    # order it was made: prefetch brings back the earlier copy and the next one, so only backward's first unpack
    # finds nothing on its way (one block ahead with per-block remat). What autograd saves straight into
    # `with remat.offload():` is not brought back ahead (the next test).
    torch.manual_seed(0)
    model = variant(Blocks(4, 8).double())
    x = randn(4, 8, requires_grad=True)
    y = model(x * 2).sum()
    waited = unpacks_that_waited(monkeypatch)
    y.backward()
    assert len(waited) > 4 and waited.count(True) == 1, waited


def unpacks_that_waited(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """From now on, one entry per unpack of an offloaded tensor: whether nothing had brought it back ahead."""
    waited: list[bool] = []
    take = _transfer._Copy.take

    def spy(copy: _transfer._Copy) -> torch.Tensor:
        ready = copy.ready
        waited.append(ready is None or ready[0] != _transfer.graph_task_id())
        return take(copy)

    monkeypatch.setattr(_transfer._Copy, "take", spy)
    return waited


def test_what_autograd_saves_in_the_block_comes_back_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Offload lifecycle ], rule 6: nothing brought back ahead, so the device holds what save_on_cpu's
    would (tests/engine/test_offload_device.py measures it)."""
    x = randn(8, 8, requires_grad=True)
    with CPU:
        y = chain_of_sines(x * 2, 6).sum()
    asked = unpacks_that_waited(monkeypatch)
    y.backward()
    assert len(asked) == 6 and all(asked), asked


def test_prefetched_tensors_that_backward_did_not_use_are_dropped(copies: Copies) -> None:
    x = randn(8, 8, requires_grad=True)
    with SITE_PACE():
        mid = chain_of_sines(x, 4)
        y = chain_of_sines(mid, 4).sum()
    torch.autograd.grad(y, mid)  # stops at `mid`: the first four sines never run, some were prefetched
    prefetched = set(copies.back)
    assert len(prefetched) > 4, "nothing was prefetched beyond what backward ran"
    parcels = [p for p in copies.parcels if p() is not None]
    assert parcels and all(p().ready is None for p in parcels)  # type: ignore[union-attr]
    assert all(ref() is None for ref in copies.brought), "an unused prefetched tensor outlived its backward"
    del y, mid


def test_two_threads_offload_at_once() -> None:
    def run(seed: int, out: dict[int, Any]) -> None:
        x = randn(16, 16, requires_grad=True, seed=seed)
        with CPU:
            y = chain_of_sines(x * 2, 8).sum()
        y.backward()
        out[seed] = x.grad

    got: dict[int, Any] = {}
    threads = [threading.Thread(target=run, args=(seed, got)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for seed in (1, 2):
        x = randn(16, 16, requires_grad=True, seed=seed)
        chain_of_sines(x * 2, 8).sum().backward()
        torch.testing.assert_close(got[seed], x.grad)


# -- what crosses (NOTE [ What crosses ]) ---------------------------------------------------------------------


class OddLayouts(nn.Module):
    """Saved tensors of every layout: the q, k and v views of one projection (strides of their own, a third of
    their storage each), permuted and transposed tensors, an expanded one, a slice dense in a larger storage and
    one sparse in it, booleans, float32 among float64, a conjugate complex view, and a zero-size tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[:2]
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        y = (q * k).exp() * v  # mul saves q, k and v; exp its output
        h = y.permute(0, 2, 1, 3)  # dense, not contiguous
        out = h.sin().flatten(2) @ self.qkv.weight[:, :8].t()  # sin saves h; mm a transposed parameter view
        big = out.repeat(1, 8, 1)  # (b, 8 s, 24)
        dense, sparse = big[-1, -s:], big[:, ::8]  # the end of `big`'s storage, holding nothing else; a sparse slice
        out = dense.sin() + sparse.cos()  # sin and cos save the slices
        wide = out[:, :1].expand(b, s, 24).exp()  # expanded: the output saved by exp
        mask = x.sum(-1, keepdim=True) > 0  # where saves the booleans
        out = torch.where(mask, out * wide, wide.to(torch.float32).sigmoid().to(out.dtype))
        pairs = torch.view_as_complex(out.reshape(b, s, 12, 2))
        c = pairs.conj()  # a conjugate view: the bit lives on the tensor
        out = torch.view_as_real(c * pairs.sin()).reshape(b, s, 24)
        empty = out[:, :, :0].exp()  # zero-size: nothing to copy
        return out.sum(-1) + empty.sum(-1)


def test_every_layout_crosses_once_each_way_with_the_gradients_of_no_remat(copies: Copies) -> None:
    _transfer.traffic(reset=True)
    assert_same_grads(OddLayouts, (randn(2, 5, 8, requires_grad=True),), in_context(CPU), expect_recompute=False)
    moved = _transfer.traffic()
    assert moved.out == len(copies.out) > 10
    assert (moved.back, moved.back_bytes) == (moved.out, moved.out_bytes), "not every copy came back exactly once"
    assert sorted(copies.back) == sorted(host for _, host in copies.out)
    assert moved.kept == moved.pageable == 0


def test_views_of_one_storage_cross_once_as_one_copy(copies: Copies) -> None:
    projection = randn(2, 6, 24) * 2  # an activation, not the user's leaf
    projection.requires_grad_()
    _transfer.traffic(reset=True)
    with CPU:
        b, s = projection.shape[:2]
        q, k, v = (projection * 1).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v).sum() + (q * k * v).sum()
    assert len(copies.storages[id(q.untyped_storage())]) == 1, "q, k and v crossed separately"
    moved = _transfer.traffic()
    assert moved.out == len(copies.out) and moved.out_bytes == _transfer.offloaded_bytes()[0]
    assert sum(parcel().nbytes == 2 * 6 * 24 * 8 for parcel in copies.parcels) == 1  # type: ignore[union-attr]
    y.backward()
    assert _transfer.traffic().back == moved.out


def test_every_copy_between_device_and_host_is_a_memcpy(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's copy_ between a device and the host stages anything but a copy of contiguous memory of one dtype
    # through temporaries of its own: for a host side that is not contiguous, pageable host memory (the 36
    # device->pageable copies of issue 44).
    copies: list[tuple[bool, bool, bool, bool]] = []
    copy_ = torch.Tensor.copy_

    def spy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        copies.append((self.is_contiguous(), src.is_contiguous(), self.dtype == src.dtype, self.shape == src.shape))
        return copy_(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    x = randn(2, 5, 8, requires_grad=True)
    model = OddLayouts().double()
    with CPU:
        y = model(x).sum()
    y.backward()
    monkeypatch.undo()
    assert copies and all(copy == (True, True, True, True) for copy in copies), copies


def test_a_sparse_slice_of_a_large_storage_crosses_alone(copies: Copies) -> None:
    x = randn(64, 64, requires_grad=True)
    with CPU:
        big = x * 1  # an activation: its slice is offloaded (a slice of the user's leaf lives anyway)
        y = big[::16, ::16].sin().sum()  # sin saves 16 elements of 4096
    # a gather of the 16, not the 4096 of the storage
    assert [parcel().nbytes for parcel in copies.parcels] == [16 * 8]  # type: ignore[union-attr]
    y.backward()
    expected = torch.zeros(64, 64, dtype=torch.float64)
    expected[::16, ::16] = x.detach()[::16, ::16].cos()
    torch.testing.assert_close(x.grad, expected)


def test_an_inplace_change_of_an_offloaded_tensor_raises() -> None:
    x = randn(8, 8, requires_grad=True)
    with CPU:
        h = x * 2
        y = h.sin().sum()  # sin saves h
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(remat.RematError, match="modified by an inplace operation"):
        y.backward()


# -- the accelerator path, on CPU: streams and events that the test completes ------------------------------


class _FakeEvent:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class _FakeStream:
    """A device stream seen from the host: its events finish when the test says so. It has no `synchronize`."""

    def __init__(self, device: FakeAccelerator, name: str) -> None:
        self.device, self.name = device, name
        self.waited: list[_FakeEvent] = []

    def wait_stream(self, other: _FakeStream) -> None:
        self.device.stream_waits.append((self.name, other.name))

    def record_event(self) -> _FakeEvent:
        event = _FakeEvent(self.device.finish_at_once)
        self.device.recorded.setdefault(self.name, []).append(event)
        return event

    def wait_event(self, event: _FakeEvent) -> None:
        self.waited.append(event)


class FakeAccelerator:
    """The device module a lane of the CPU calls, as an accelerator's: streams, events, pinned host memory."""

    def __init__(self, finish_at_once: bool) -> None:
        self.finish_at_once = finish_at_once
        self.recorded: dict[str, list[_FakeEvent]] = {}
        self.stream_waits: list[tuple[str, str]] = []
        self.compute = _FakeStream(self, "compute")
        self.current = self.compute
        self.pins: list[bool] = []
        self.copies: list[str] = []  # the stream every copy between the lane's memory ran on

    def current_stream(self, device: Any = None) -> _FakeStream:
        return self.current

    @contextmanager
    def stream(self, stream: _FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def finish(self) -> None:
        for events in self.recorded.values():
            for event in events:
                event.done = True


@pytest.fixture
def accelerated(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], FakeAccelerator]:
    """Make the CPU's lane an accelerator's (`finish_at_once`: every copy is done as soon as it is queued)."""

    def install(finish_at_once: bool) -> FakeAccelerator:
        fake = FakeAccelerator(finish_at_once)
        lane = _transfer._Lane(torch.device("cpu"))
        lane.module, lane.asynchronous = fake, True
        lane.out_stream, lane.back_stream = _FakeStream(fake, "out"), _FakeStream(fake, "back")
        monkeypatch.setitem(_transfer._lanes, torch.device("cpu"), lane)

        def host(source: torch.Tensor, pin: bool) -> torch.Tensor:
            fake.pins.append(pin)
            return torch.empty_like(source, memory_format=torch.contiguous_format)  # a CPU-only build pins nothing

        copy_ = torch.Tensor.copy_

        def spy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            fake.copies.append(fake.current.name)
            assert non_blocking == fake.pins[-1], "a copy with pinned memory blocked the host"
            return copy_(self, src, non_blocking)

        monkeypatch.setattr(_transfer, "_host", host)
        monkeypatch.setattr(torch.Tensor, "copy_", spy)
        return fake

    return install


@pytest.mark.parametrize("make", [OddLayouts, TransformerBlock], ids=["odd_layouts", "transformer"])
@pytest.mark.parametrize("pace", ["block", "site"])
def test_on_an_accelerator_copies_are_pinned_on_side_streams_and_cross_once_each_way(
    make: Callable[[], nn.Module], pace: str, accelerated: Callable[[bool], FakeAccelerator]
) -> None:
    fake = accelerated(True)
    _transfer.traffic(reset=True)
    shape = (2, 5, 8)
    context = CPU if pace == "block" else SITE_PACE()
    assert_same_grads(make, (randn(*shape, requires_grad=True),), in_context(context), expect_recompute=False)
    moved = _transfer.traffic()
    assert moved.out > 0 and (moved.back + moved.kept, moved.back_bytes + moved.kept_bytes) == (moved.out,
                                                                                                moved.out_bytes)
    # the block ends by releasing what finished; the site's hooks here never do, so its last copy is still held
    assert moved.kept <= (0 if pace == "block" else 1) and moved.pageable == 0
    assert fake.pins and all(fake.pins), "a host copy was not pinned"
    assert fake.copies == ["out"] * moved.out + ["back"] * moved.back, "a copy ran on the compute stream"
    assert fake.stream_waits == [("out", "compute")] * moved.out + [("back", "compute")] * moved.back
    waited = {id(event) for event in fake.compute.waited}
    back, out = ({id(event) for event in fake.recorded[kind]} for kind in ("back", "out"))
    # compute waits, on the device, for every copy back; and in the block for every copy to host at once (its
    # memory goes back to the allocator with no copy in flight: NOTE [ Offload lifecycle ], rule 6)
    assert waited == (back | out if pace == "block" else back)


def test_the_blocks_copies_hold_no_device_memory_past_their_pack(accelerated: Callable[[bool], FakeAccelerator],
                                                                 copies: Copies) -> None:
    fake = accelerated(False)  # no copy to host ever finishes on its own: the worst a host link can do
    lane = _transfer._lanes[torch.device("cpu")]
    _transfer.traffic(reset=True)
    x = randn(8, 8, requires_grad=True)
    with CPU:
        h = x * 2
        y = chain_of_sines(h, 6).sum()
    storage = weakref.ref(h.untyped_storage())
    del h
    assert not lane.pending and storage() is None, "the block held device memory while its copy ran"
    assert len(fake.compute.waited) == 6  # the compute stream waits for each copy, on the device
    y.backward()
    moved = _transfer.traffic()
    assert (moved.out, moved.back, moved.kept) == (6, 6, 0)


def test_memory_still_held_when_backward_begins_is_not_copied_back(
    accelerated: Callable[[bool], FakeAccelerator], copies: Copies
) -> None:
    fake = accelerated(False)  # no copy to host finishes before backward: the device still holds every tensor
    _transfer.traffic(reset=True)
    x = randn(8, 8, requires_grad=True)
    with SITE_PACE():
        y = chain_of_sines(x * 2, 6).sum()
    moved = _transfer.traffic()
    assert moved.out == 6 and len(_transfer._lanes[torch.device("cpu")].pending) == 6
    y.backward()
    expected = randn(8, 8, requires_grad=True)
    chain_of_sines(expected * 2, 6).sum().backward()
    torch.testing.assert_close(x.grad, expected.grad)
    moved = _transfer.traffic()
    assert (moved.kept, moved.kept_bytes, moved.back) == (moved.out, moved.out_bytes, 0)
    fake.finish()
    _transfer.reap()
    assert not _transfer._lanes[torch.device("cpu")].pending


def test_a_graph_dropped_while_its_copies_run_frees_the_host_at_once_and_the_device_when_they_finish(
    accelerated: Callable[[bool], FakeAccelerator],
) -> None:
    fake = accelerated(False)
    lane = _transfer._lanes[torch.device("cpu")]
    x = randn(8, 8, requires_grad=True)
    with SITE_PACE():
        h = x * 2
        y = chain_of_sines(h, 6).sum()
    storages = [weakref.ref(h.untyped_storage())]
    del h
    assert _transfer.live_parcels() == 6 and len(lane.pending) == 6
    del y  # no cycle: the host copies go with the graph, without gc
    assert _transfer.live_parcels() == 0 and _transfer.offloaded_bytes()[0] == 0
    assert storages[0]() is not None, "the device memory went back to the allocator while its copy still read it"
    fake.finish()
    _transfer.reap()
    assert not lane.pending and storages[0]() is None


def test_an_inplace_change_of_memory_still_held_raises(accelerated: Callable[[bool], FakeAccelerator]) -> None:
    accelerated(False)
    x = randn(8, 8, requires_grad=True)
    with SITE_PACE():
        h = x * 2
        y = h[:4].sin().sum()  # sin saves a view of h; its Python object is gone after forward
    with torch.no_grad():
        h[4:].add_(1)  # through another view of the same memory, as autograd would see it
    del h
    with pytest.raises(remat.RematError, match="modified by an inplace operation"):
        y.backward()


def test_a_copy_comes_back_only_after_its_copy_to_host_is_done_or_waited_for(
    accelerated: Callable[[bool], FakeAccelerator], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The back stream does not wait for the out stream: a copy brought back must have been released by the lane
    # (its copy to host done, or the compute stream made to wait for it, which the back stream waits for).
    fake = accelerated(False)
    monkeypatch.setattr(_transfer, "_PENDING_BYTES", 2 * 8 * 8 * 8)  # two of the 8x8 float64 activations
    out_events: dict[int, _FakeEvent] = {}
    back_checked: list[bool] = []
    out, back = _transfer._Lane.out, _transfer._Lane.back

    def spy_out(lane: Any, source: torch.Tensor, pin: bool, copy: Any, nbytes: int, *pace: bool) -> torch.Tensor:
        host = out(lane, source, pin, copy, nbytes, *pace)
        out_events[id(host)] = fake.recorded["out"][-1]
        return host

    def spy_back(lane: Any, host: torch.Tensor, pinned: bool) -> tuple[torch.Tensor, Any, Any]:
        event = out_events[id(host)]
        back_checked.append(event.done or any(event is waited for waited in fake.compute.waited))
        return back(lane, host, pinned)

    monkeypatch.setattr(_transfer._Lane, "out", spy_out)
    monkeypatch.setattr(_transfer._Lane, "back", spy_back)
    _transfer.traffic(reset=True)
    x = randn(8, 8, requires_grad=True)
    with SITE_PACE():
        y = chain_of_sines(x * 2, 8).sum()
    y.backward()
    expected = randn(8, 8, requires_grad=True)
    chain_of_sines(expected * 2, 8).sum().backward()
    torch.testing.assert_close(x.grad, expected.grad)
    moved = _transfer.traffic()
    assert moved.back > 0 and moved.kept > 0 and moved.back + moved.kept == moved.out == 8
    assert back_checked and all(back_checked), "a copy came back while its copy to host could still be running"


def test_memory_still_held_of_every_layout_gives_the_gradients_of_no_remat(
    accelerated: Callable[[bool], FakeAccelerator],
) -> None:
    fake = accelerated(False)
    _transfer.traffic(reset=True)
    assert_same_grads(OddLayouts, (randn(2, 5, 8, requires_grad=True),), in_context(SITE_PACE()),
                      expect_recompute=False)
    moved = _transfer.traffic()
    assert moved.out > 10 and (moved.kept, moved.back) == (moved.out, 0)
    fake.finish()
    _transfer.reap()


def test_without_pinned_memory_every_copy_is_counted_pageable(accelerated: Callable[[bool], FakeAccelerator]) -> None:
    fake = accelerated(True)
    _transfer.traffic(reset=True)
    x = randn(8, 8, requires_grad=True)
    with remat.offload(min_bytes=0, include_cpu=True, pin_memory=False):
        y = chain_of_sines(x * 2, 4).sum()
    y.backward()
    moved = _transfer.traffic()
    assert not any(fake.pins)
    assert moved.pageable == moved.out + moved.back == 8


def test_device_memory_is_held_until_its_copy_is_done_and_in_flight_bytes_are_bounded(
    monkeypatch: pytest.MonkeyPatch, accelerated: Callable[[bool], FakeAccelerator]
) -> None:
    fake = accelerated(False)
    lane = _transfer._lanes[torch.device("cpu")]
    monkeypatch.setattr(_transfer, "_PENDING_BYTES", 3 * 4096)
    tensors = [torch.full((1024,), float(i)) for i in range(5)]  # 4 KiB each
    storages = [weakref.ref(t.untyped_storage()) for t in tensors]
    parcels = [_transfer.pack(t, True, {}) for t in tensors]
    del tensors
    events = fake.recorded["out"]
    # Five copies in flight is two more than the bound: the compute stream waits on the two oldest copies
    # (on the device, not the host) and their memory goes back to the allocator; the others are held.
    assert fake.compute.waited == events[:2] and lane.out_stream.waited == []
    assert [ref() is None for ref in storages] == [True, True, False, False, False]
    events[2].done = events[4].done = True
    lane.reap()  # copies finish in order: #2 is released, #3 holds #4 back
    assert [ref() is None for ref in storages] == [True, True, True, False, False]
    events[3].done = True
    lane.reap()
    assert all(ref() is None for ref in storages) and lane.pending_bytes == 0
    assert [float(p.copy.host[0]) for p in parcels] == [0.0, 1.0, 2.0, 3.0, 4.0]


# -- sites -------------------------------------------------------------------------------------------------


class Doubled(nn.Module):
    """`inner(x * 2)`: the input of `inner` is an activation, not the user's leaf (which is never offloaded)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x * 2)
        return out


class Blocks(nn.Module):
    def __init__(self, n: int = 3, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP(width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize(
    "variant",
    [
        lambda m: remat.apply(m, offload=CPU),
        lambda m: remat.apply(m, offload=CPU, strategy="replay"),
    ],
    ids=["apply", "apply_replay"],
)
def test_sites_offload_their_inputs_and_never_what_they_recompute(
    variant: Callable[[nn.Module], nn.Module], copies: Copies
) -> None:
    assert_same_grads(Blocks, (randn(4, 8, requires_grad=True),), variant)
    # the inputs of blocks 2 and 3 (block 1's input is the user's leaf, which lives anyway), each once
    assert [shape for shape, _ in copies.out if shape == (4, 8)] == [(4, 8)] * 2
    # and nothing the blocks recompute
    assert {shape for shape, _ in copies.out} == {(4, 8)}
    assert len(copies.back) == len(copies.out), "each copy comes back once"


@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_save_matmuls_with_offload_copies_the_kept_matmul_outputs(strategy: str, copies: Copies) -> None:
    assert_same_grads(
        Blocks, (randn(4, 8, requires_grad=True),),
        lambda m: remat.apply(m, offload=CPU, policy=policies.save_matmuls, strategy=strategy),  # type: ignore[arg-type]
    )
    # per block: fc1's and fc2's outputs (4, 16) and fc3's (4, 8), which is also the next block's input
    # (one copy for both); the tanh and relu outputs are recomputed. Replay keeps only what a replay reads:
    # the last block's fc3 output is the model's, read by no replay, so it is not copied.
    shapes = [shape for shape, _ in copies.out]
    assert shapes.count((4, 16)) == 6 and shapes.count((4, 8)) == (3 if strategy == "rerun" else 2)


def test_decorator_module_and_region_sites(copies: Copies) -> None:
    def module(m: nn.Module) -> nn.Module:
        remat.remat(m.inner, offload=CPU)
        return m

    assert_same_grads(lambda: Doubled(MLP()), (randn(4, 8, requires_grad=True),), module)
    assert [shape for shape, _ in copies.out] == [(4, 8)]

    def doubled_sines(x: torch.Tensor) -> torch.Tensor:
        return chain_of_sines(x * 2)

    def decorated(fn: Any) -> Any:
        sines = remat.remat(offload=CPU)(chain_of_sines)
        return lambda x: sines(x * 2)

    assert_same_grads(lambda: doubled_sines, (randn(4, 8, requires_grad=True),), decorated)
    assert [shape for shape, _ in copies.out] == [(4, 8)] * 2

    def region(m: nn.Module) -> Callable[..., torch.Tensor]:
        def call(x: torch.Tensor) -> torch.Tensor:
            h = x * 2
            with remat.region(offload=CPU):
                out: torch.Tensor = m.inner(h)
            return out

        return call

    assert_same_grads(lambda: Doubled(TransformerBlock()), (randn(2, 5, 8, requires_grad=True),), region)
    assert [shape for shape, _ in copies.out] == [(4, 8)] * 2 + [(2, 5, 8)]


def _frames() -> list[weakref.ref[object]]:
    gc.collect()
    return [weakref.ref(obj) for obj in gc.get_objects() if type(obj).__name__ in ("RerunFrame", "RegionFrame")]


@pytest.mark.parametrize("policy", [None, policies.save_matmuls], ids=["all", "save_matmuls"])
@pytest.mark.parametrize("strategy", ["rerun", "replay"])
@pytest.mark.parametrize("backward", ["backward", "retain_graph_twice", "create_graph", "none"])
def test_offloading_sites_leave_nothing_behind(strategy: str, backward: str, policy: Any) -> None:
    before = {id(ref()) for ref in _frames()}
    model = Doubled(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Softplus()).double())
    remat.remat(model.inner, offload=CPU, strategy=strategy, policy=policy)  # type: ignore[call-overload]
    x = randn(4, 8, requires_grad=True)
    y = model(x).sum()
    refs = [ref for ref in _frames() if id(ref()) not in before]
    assert len(refs) == 1 and _transfer.live_parcels() == (1 if policy is None else 3)  # input, 2 matmul outputs
    params = list(model.parameters())
    if backward == "backward":
        y.backward()
    elif backward == "retain_graph_twice":
        y.backward(retain_graph=True)
        y.backward()
    elif backward == "create_graph":
        grads = torch.autograd.grad(y, params, create_graph=True)
        sum((g * g).sum() for g in grads).backward()
        del grads
    del y
    assert refs[0]() is None, "the frame outlived its graph (a cycle through C++ that gc cannot see)"
    assert _transfer.live_parcels() == 0


def test_an_exception_inside_an_offloading_site_leaves_nothing_behind() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.sin().exp()
        if h.sum() > -1:
            raise ZeroDivisionError
        return h

    site = remat.remat(offload=CPU)(fn)
    with pytest.raises(ZeroDivisionError):
        site(randn(8, 8, requires_grad=True) * 2)
    gc.collect()
    assert _transfer.live_parcels() == 0
    assert_same_grads(lambda: chain_of_sines, (randn(4, 4, requires_grad=True),), remat.remat(offload=CPU))


def test_an_offloading_site_holds_no_input_on_the_device() -> None:
    def held(offload: Any) -> int:
        model = remat.apply(Blocks(3, 64).double(), offload=offload)
        x = randn(32, 64, requires_grad=True)
        with remat.track() as t:
            y = model(x * 2)
            held = t.current_bytes
        y.sum().backward()
        return held

    # Without offload the blocks keep their inputs: 3 of 32x64 float64 (x * 2 and two block outputs,
    # the last of which is the output itself); with offload they are on the host.
    assert held(False) - held(CPU) >= 2 * 32 * 64 * 8


def test_policy_offload_keeps_matmul_outputs_on_the_host(
    copies: Copies, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_offload, "_default", [CPU])  # policies.offload uses the default settings
    policy = policies.offload(policies.save_matmuls)
    assert_same_grads(MLP, (randn(4, 8, requires_grad=True),), lambda m: remat.remat(m, policy=policy))
    # fc1, fc2, fc3 outputs; not the input (the site itself does not offload)
    assert sorted(shape for shape, _ in copies.out) == [(4, 8), (4, 16), (4, 16)]
    copies.out.clear()

    def region(m: nn.Module) -> Callable[..., torch.Tensor]:
        def call(x: torch.Tensor) -> torch.Tensor:
            with remat.region(policy=policy):
                out: torch.Tensor = m(x)
            return out

        return call

    assert_same_grads(MLP, (randn(4, 8, requires_grad=True),), region)
    # in a region, fc1's and fc2's outputs; fc3's is the region's output, which no replay reads
    assert sorted(shape for shape, _ in copies.out) == [(4, 16), (4, 16)]


def test_policy_offload_with_tags(copies: Copies, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_offload, "_default", [CPU])

    def fn(x: torch.Tensor) -> torch.Tensor:
        return remat.tag(x.sin() * 3, "h").cos().exp()

    assert_same_grads(lambda: fn, (randn(4, 8, requires_grad=True),),
                      remat.remat(policy=policies.offload(policies.save_tagged("h"))))
    assert [shape for shape, _ in copies.out] == [(4, 8)]


def test_policy_offload_repr_and_errors() -> None:
    assert repr(policies.offload(policies.save_matmuls)) == "offload(matmuls)"
    with pytest.raises(ValueError, match=r"remat\.offload"):
        policies.offload(policies.save_all)
    with pytest.raises(ValueError, match="offload"):
        policies.offload(policies.save_matmuls) | policies.save_tagged("a")


# -- nesting -----------------------------------------------------------------------------------------------


def test_offload_around_rematerialized_blocks_copies_only_their_inputs(copies: Copies) -> None:
    assert_same_grads(Blocks, (randn(4, 8, requires_grad=True),), lambda m: in_context(CPU)(remat.apply(m)))
    assert copies.out and all(shape == (4, 8) for shape, _ in copies.out)


def test_a_site_inside_an_offloading_site_leaves_its_inputs_to_it(copies: Copies) -> None:
    def nest(model: nn.Module) -> nn.Module:
        for block in model.inner.blocks:
            remat.remat(block, offload=CPU)
        remat.remat(model.inner, offload=CPU)
        return model

    assert_same_grads(lambda: Doubled(Blocks(2)), (randn(4, 8, requires_grad=True),), nest)
    assert [shape for shape, _ in copies.out] == [(4, 8)], "only the outer site's input goes to host"


def test_a_region_inside_an_offloading_decorated_function() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        with remat.region():
            h = x.sin().exp()
        return h.tanh()

    assert_same_grads(lambda: fn, (randn(4, 8, requires_grad=True),), remat.remat(offload=CPU))
    assert_same_grads(lambda: fn, (randn(4, 8, requires_grad=True),), in_context(CPU))


def test_a_chain_inside_offload() -> None:
    torch.manual_seed(0)
    stages = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]).double()
    budgeted = chain(copy.deepcopy(stages), segments=2)
    x = randn(8, 16)
    for model in (stages, budgeted):
        for p in model.parameters():
            p.grad = None
    stages(x).sum().backward()
    with CPU:
        y = budgeted(x).sum()
    y.backward()
    for p, q in zip(stages.parameters(), budgeted.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)


# -- options -----------------------------------------------------------------------------------------------


def test_offload_inside_a_rerun_function_is_a_clear_error() -> None:
    @remat.remat(name="block")
    def block(x: torch.Tensor) -> torch.Tensor:
        with CPU:
            return x.sin().exp()

    with pytest.raises(remat.RematError, match=r"inside the rematerialized function `block`.*offload=True"):
        block(randn(4, 4, requires_grad=True))

    def in_region(fn: Any) -> Callable[..., torch.Tensor]:
        def call(x: torch.Tensor) -> torch.Tensor:
            with remat.region(), CPU:  # replay does not run Python again: fine
                out: torch.Tensor = fn(x)
            return out

        return call

    assert_same_grads(
        lambda: lambda x: x.sin().exp(), (randn(4, 4, requires_grad=True),), in_region, expect_recompute=False
    )


def test_bad_offload_options_are_clear_errors() -> None:
    with pytest.raises(TypeError, match=r"remat: `offload` must be True, False or remat.offload"):
        remat.remat(offload="yes")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="min_bytes"):
        remat.offload(min_bytes=-1)
    with pytest.raises(TypeError, match="pin_memory"):
        remat.offload(pin_memory=1)  # type: ignore[arg-type]


def test_a_module_that_offloads_pickles_deep_copies_and_shows_in_its_plan() -> None:
    model = remat.apply(Blocks(2), offload=remat.offload(min_bytes=4096))
    clone = pickle.loads(pickle.dumps(model))
    again = copy.deepcopy(model)
    assert "offload" in str(remat.plan(clone)) and "offload" in str(remat.plan(again))
    x = torch.randn(2, 8)
    torch.testing.assert_close(clone(x), model(x))


# -- on a device (the `accelerator` fixture: CUDA where there is a GPU, and the device written in Python) -----

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _device_model(device: str = "cuda") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[MLP(256) for _ in range(4)]).to(device)


def _grads(model: nn.Module, x: torch.Tensor, offload: AbstractContextManager[Any], hook: Any = None) -> list[Any]:
    for p in model.parameters():
        p.grad = None
    with offload:
        y = model(x).square().sum()
    if hook is not None:
        hook()
    y.backward()
    return [p.grad.clone() for p in model.parameters()]


def _synchronize(device: str) -> None:
    torch.get_device_module(device).synchronize()


@pytest.mark.cuda
@cuda
def test_cuda_copies_run_on_a_side_stream_without_synchronizing_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _device_model(), torch.randn(512, 256, device="cuda")
    expected = _grads(model, x, nullcontext())
    streams: list[Any] = []
    copy_ = torch.Tensor.copy_

    def spy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if self.device != src.device:
            streams.append(torch.cuda.current_stream())
            assert non_blocking, "a copy between host and device blocked the host"
        return copy_(self, src, non_blocking)

    def no_sync(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("offload synchronized the whole device")

    offload = remat.offload()
    _grads(model, x, offload)  # warm-up: pinned host blocks are allocated once, then cached
    _transfer.traffic(reset=True)
    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", no_sync)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", no_sync)
    previous = torch.cuda.get_sync_debug_mode()
    try:
        # Any synchronizing CUDA call raises. Setting the mode warns once that it is a prototype, after it is set:
        # under filterwarnings=error that warning raised here, outside the `finally`, left the mode on, and the
        # tests after this one failed on it. The notice is silenced, and the mode restored whatever happens.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
            torch.cuda.set_sync_debug_mode("error")
        got = _grads(model, x, offload)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        monkeypatch.undo()
    torch.cuda.synchronize()
    assert streams, "nothing was copied"
    moved = _transfer.traffic()
    assert moved.pageable == 0 and moved.back + moved.kept == moved.out
    compute = torch.cuda.current_stream()
    assert all(stream != compute for stream in streams), "a copy ran on the compute stream"
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


def test_overwriting_freed_memory_after_forward_does_not_change_gradients(accelerator: str) -> None:
    model, x = _device_model(accelerator), torch.randn(512, 256).to(accelerator)
    expected = _grads(model, x, nullcontext())

    def scribble() -> None:
        # Right after forward, with no synchronization: take blocks the size of the activations and fill them
        # with NaN on the compute stream. Had offload released a device tensor before its copy to host ran on
        # the side stream, the copy would read NaN.
        junk = [torch.full(shape, float("nan"), device=accelerator) for shape in [(512, 512), (512, 256)] * 64]
        del junk

    for offload in (remat.offload(), remat.offload(pin_memory=False)):
        got = _grads(model, x, offload, scribble)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e)
    _synchronize(accelerator)
    _transfer.reap()
    assert all(not lane.pending for lane in _transfer._lanes.values()), "device tensors held after their copy"


def test_per_block_remat_with_offload_holds_less_on_the_device(accelerator: str) -> None:
    def held(offload: bool) -> int:
        model = remat.apply(_device_model(accelerator), MLP, offload=offload)
        x = torch.randn(4096, 256).to(accelerator).requires_grad_()
        _synchronize(accelerator)
        with remat.track() as tracker:
            y = model(x * 2)
            _synchronize(accelerator)
            _transfer.reap()
            held = tracker.current(x.device)
        y.square().sum().backward()
        return held

    # the inputs of blocks 2 to 4 (4096 x 256 float32 each) leave the device
    assert held(True) <= held(False) - 3 * 4096 * 256 * 4


@pytest.mark.cuda
@cuda
@pytest.mark.filterwarnings("ignore:.*Profiler clears events")  # torch 2.11's profiler, once per process
@pytest.mark.parametrize("per_block", [False, True], ids=["offload", "per_block"])
def test_cuda_profile_shows_pinned_copies_only_each_crossing_once_each_way(per_block: bool) -> None:
    # What the profile counted, on the benchmark's model with bf16 autocast and fused attention with
    # dropout (whose outputs and q, k, v views took the pageable path): no copy to or from pageable memory, as
    # many device->pinned copies as offload made, as many pinned->device copies as it brought back.
    from torch.profiler import ProfilerActivity, profile

    from remat._demo import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(blocks=3, d=256, heads=4, seq=256, batch=4, vocab=512)).cuda().train()
    batch = model.sample(torch.device("cuda"))
    offload = remat.offload()
    if per_block:
        for block in model.blocks:
            remat.remat(block, offload=offload)

    def step() -> None:
        with (nullcontext() if per_block else offload), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(*batch)
        loss.backward()

    step()  # warm-up: pinned host blocks are allocated once, then cached
    torch.cuda.synchronize()
    _transfer.traffic(reset=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    moved = _transfer.traffic()
    names = [event.name for event in prof.events() if event.name.startswith("Memcpy")]
    assert not [name for name in names if "Pageable" in name], names
    assert names.count("Memcpy DtoH (Device -> Pinned)") == moved.out > 0
    assert names.count("Memcpy HtoD (Pinned -> Device)") == moved.back
    assert moved.back + moved.kept == moved.out and moved.back_bytes + moved.kept_bytes == moved.out_bytes


@pytest.mark.cuda
@cuda
def test_cuda_offload_block_peaks_as_save_on_cpu() -> None:
    """NOTE [ Offload lifecycle ], rule 6, on a GPU: `max_memory_allocated` above the step's start (the quantity
    of the offload benchmark, where the block once peaked 1.33x `save_on_cpu`'s), within 1.05x."""
    from remat._demo import GPT, GPTConfig

    torch.manual_seed(0)
    base = GPT(GPTConfig(blocks=4, d=512, heads=8, seq=512, batch=8, vocab=1024)).cuda().train()
    batch = base.sample(torch.device("cuda"))
    peaks: dict[str, int] = {}
    contexts: dict[str, Callable[[], AbstractContextManager[Any]]] = {
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
        "offload": remat.offload,
    }
    for name, context in contexts.items():
        model = copy.deepcopy(base)
        for _ in range(2):  # the second step: pinned host blocks cached, as in a training loop
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            with context(), torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model.loss(*batch)
            loss.backward()
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() - before
        del model, loss
    assert peaks["offload"] <= 1.05 * peaks["save_on_cpu"], peaks
