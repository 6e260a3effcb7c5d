"""The tracker sees storage resizes (`untyped_storage().resize_`), the way FSDP2 frees and re-allocates parameters."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from conftest import free_port
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import remat
from remat._measure.fake import FakeTracker, fake_mode


def test_resize_to_zero_frees_and_resize_up_allocates() -> None:
    with remat.track() as t:
        x = torch.zeros(1000)
        x.untyped_storage().resize_(0)
        assert t.current_bytes == 0
        x.untyped_storage().resize_(400)
        assert t.current_bytes == 400
    assert t.peak_bytes == 4000
    # torch's own method is back once no tracker is open (an `FSDPMemTracker` may have left it in the class's dict)
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_


def test_storage_grown_from_nothing_inside_the_block_is_counted_until_freed() -> None:
    y = torch.zeros(10)
    y.untyped_storage().resize_(0)  # freed before the block, as FSDP leaves unsharded parameters
    with remat.track() as outer, remat.track() as inner:
        y.untyped_storage().resize_(40)
        assert (outer.current_bytes, inner.current_bytes) == (40, 40)
        del y
        assert (outer.current_bytes, inner.current_bytes) == (0, 0)


def test_fake_storage_resizes_count_on_the_claimed_device() -> None:
    with fake_mode(), FakeTracker() as t:
        x = torch.empty(256, device="cpu")
        x.untyped_storage().resize_(0)
        assert t.current("cpu") == 0
        x.untyped_storage().resize_(1024)
        assert t.current("cpu") == 1024


def test_fsdp2_frees_are_seen_in_a_real_step() -> None:
    """After a step of a `fully_shard`ed model, only the optimizer's state is left of what the step made.

    Without resizes counted, the unsharded parameters FSDP2 freed with `resize_(0)` stayed counted.
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3)])
        mesh = init_device_mesh("cpu", (1,))  # named: the default is the current accelerator's (tests/pydevice.py)
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        unsharded = sum(p.numel() * 4 for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(4, 16)
        with remat.track() as t:
            for _ in range(2):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            live = sum(v.untyped_storage().nbytes() for v in state)
            assert t.current_bytes == live, (t.current_bytes, live)
        assert t.peak_bytes >= live + unsharded, "the unsharded parameters were counted while they lived"
    finally:
        dist.destroy_process_group()
