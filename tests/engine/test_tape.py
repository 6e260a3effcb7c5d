"""Tests of the replay tape's structure: what its entries hold, and scripts shared between tapes (NOTE [ What the tape
holds ] in remat/_engine/recorder.py, NOTE [ Shared scripts ] in remat/_engine/tape.py)."""
# mypy: disable-error-code="no-untyped-call,no-any-return"

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch

from remat._engine import guard as _guard
from remat._engine import region as _region
from remat._engine import tape as _tape
from remat._engine.region import RegionFrame, begin_replay, end_replay

pytestmark = pytest.mark.usefixtures("float64_default")


def _recorded(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, RegionFrame]:
    token = begin_replay(site="test")
    try:
        out = fn(x)
    finally:
        end_replay(token)
    assert isinstance(token, RegionFrame)
    return out, token


def _block(x: torch.Tensor) -> torch.Tensor:
    h = torch.nn.functional.gelu(x @ x.T)
    return torch.softmax(h, dim=-1).exp()


def test_tapes_of_the_same_structure_share_one_script_and_give_no_remats_gradients() -> None:
    xs = [torch.randn(5, 5, requires_grad=True) for _ in range(3)]
    frames = []
    for x in xs:
        out, frame = _recorded(_block, x)
        out.sum().backward()
        frames.append(frame)
    scripts = [frame.tape.script for frame in frames if frame.tape is not None]
    assert len(scripts) == 3 and scripts[0] is not None
    assert scripts[1] is scripts[0] and scripts[2] is scripts[0]
    for x in xs:
        y = x.detach().requires_grad_()
        _block(y).sum().backward()
        torch.testing.assert_close(x.grad, y.grad)


def test_a_different_structure_gets_a_script_of_its_own() -> None:
    small, frame_small = _recorded(_block, torch.randn(4, 4, requires_grad=True))
    other, frame_other = _recorded(lambda x: _block(x).sin(), torch.randn(4, 4, requires_grad=True))
    small.sum().backward()
    other.sum().backward()
    assert frame_small.tape is not None and frame_other.tape is not None
    assert frame_small.tape.script is not frame_other.tape.script


def test_values_that_compare_equal_are_replayed_from_each_tapes_own_recording() -> None:
    # `0.0 == -0.0`, so both tapes have the same structure and share a script; the sign still matters: atan2 of a
    # signed zero is +pi or -pi, and `w`'s gradient is that value, rebuilt by replay.
    x = torch.full((3,), -1.0, requires_grad=True)
    grads = []
    for bound in (0.0, -0.0, 0.0):
        w = torch.ones(3, requires_grad=True)
        token = begin_replay(site="test")
        try:
            angle = torch.atan2(x.clamp(min=bound), -torch.ones(3))
            out = (angle * w).sum()
        finally:
            end_replay(token)
        out.backward()
        assert isinstance(token, RegionFrame) and token.tape is not None
        grads.append(w.grad)
    torch.testing.assert_close(grads[0], torch.full((3,), torch.pi))
    torch.testing.assert_close(grads[1], torch.full((3,), -torch.pi))
    torch.testing.assert_close(grads[2], torch.full((3,), torch.pi))


def test_scripts_cached_are_bounded_and_hold_no_tensor() -> None:
    for size in range(2, 2 + _tape._SCRIPTS_KEPT + 8):
        out, _ = _recorded(_block, torch.randn(size, size, requires_grad=True))
        out.sum().backward()
    assert len(_tape._SCRIPTS) <= _tape._SCRIPTS_KEPT
    entries = [entry for ops, _ in _tape._SCRIPTS.values() for entry in ops]
    held = [value for entry in entries for value in (*entry[1], *(entry[2] or {}).values())]
    assert not any(isinstance(value, torch.Tensor) for value in held)


def test_inputs_of_ops_taking_tensor_lists_are_not_held_by_the_tape() -> None:
    x = torch.randn(4, requires_grad=True)
    refs: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        a, b = x.sin(), x.cos()
        refs.extend((weakref.ref(a), weakref.ref(b)))
        return torch.cat([a, b]).exp()  # exp saves its output: the tape lives until backward

    _recorded(fn, x)  # the first call of an op takes the general path: the second must hold nothing either
    refs.clear()
    out, frame = _recorded(fn, x)
    gc.collect()
    assert frame.tape is not None
    assert all(ref() is None for ref in refs), "the tape kept cat's inputs alive"
    out.sum().backward()
    y = x.detach().requires_grad_()
    torch.cat([y.sin(), y.cos()]).exp().sum().backward()
    torch.testing.assert_close(x.grad, y.grad)


def test_a_write_into_a_new_tensor_at_a_dead_saved_tensors_address_clones_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Storage keys are addresses, reused once a storage dies. The allocator reuses them when it likes; here every
    # storage of 512 bytes gets one key, so that the reuse happens on every run.
    def key(tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        return 1 if storage.nbytes() == 512 else storage.data_ptr()

    monkeypatch.setattr(_region, "_storage_id", key)
    monkeypatch.setattr(_guard, "_storage_id", key)
    x = torch.randn(32, requires_grad=True)
    torch.manual_seed(0)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.repeat(2).exp()  # 64 doubles: exp saves its output, key 1
        out = h * 2.0
        del h  # only the region's handle is left: the storage dies
        mask = torch.empty(64).bernoulli_(0.5)  # a new storage under key 1, written in place
        return out * mask

    out, frame = _recorded(fn, x)
    assert frame.tape is not None
    assert not any(clone for *_, clone in frame.tape._replayed())
    out.sum().backward()
    torch.manual_seed(0)
    y = x.detach().requires_grad_()
    fn(y).sum().backward()
    torch.testing.assert_close(x.grad, y.grad)


def test_entries_that_cannot_be_compared_get_a_script_of_their_own() -> None:
    first, frame = _recorded(_block, torch.randn(3, 3, requires_grad=True))
    first.sum().backward()
    assert frame.tape is not None and frame.tape.script is not None
    cached = next(ops for ops, script in _tape._SCRIPTS.values() if script is frame.tape.script)
    func, args, *rest = cached[0]
    cached[0] = (func, [torch.ones(2), *args[1:]], *rest)  # `==` on it raises: a tensor is no bool
    x = torch.randn(3, 3, requires_grad=True)
    out, other = _recorded(_block, x)
    out.sum().backward()
    assert other.tape is not None and other.tape.script is not frame.tape.script
    y = x.detach().requires_grad_()
    _block(y).sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
