"""A recompute mismatch is torch's `CheckpointError` too, and says so in torch's words, then remat's.

Code written for `torch.utils.checkpoint` catches `except CheckpointError`; people who searched torch's message
find the same sentence, followed by the site's name and what to do.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import randn
from torch.utils.checkpoint import CheckpointError

import remat

MORE = "torch.utils.checkpoint: trying to save more tensors during recomputation than during the original forward pass"
COUNT = "torch.utils.checkpoint: A different number of tensors was saved during the original forward and recomputation"
METADATA = (
    "torch.utils.checkpoint: Recomputed values for the following tensors have different metadata than during the "
    "forward pass"
)
ADVICE = "strategy='replay'"


def _counted(first: Callable[[torch.Tensor], torch.Tensor], again: Callable[[torch.Tensor], torch.Tensor]
             ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function that runs `first` in forward and `again` in every later call (the recompute)."""
    calls: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return first(x) if len(calls) == 1 else again(x)

    return fn


def _torch_error(fn: Callable[[torch.Tensor], torch.Tensor], early_stop: bool = True) -> str:
    """The message torch's own checkpoint gives for `fn` (a fresh copy of it)."""
    with pytest.raises(CheckpointError) as info, torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        out = torch.utils.checkpoint.checkpoint(fn, randn(4, requires_grad=True), use_reentrant=False,
                                                 preserve_rng_state=False)
        out.sum().backward()
    return str(info.value)


def _remat_error(run: Callable[[], None]) -> str:
    try:
        run()
    except CheckpointError as error:  # what code written for torch's checkpoint catches
        assert isinstance(error, remat.RecomputeMismatchError) and isinstance(error, remat.RematError)
        return str(error)
    raise AssertionError("no CheckpointError was raised")


def _wide(x: torch.Tensor) -> torch.Tensor:
    h = x.exp()
    return torch.cat([h, h]).sin().sum() * x


def _narrow(x: torch.Tensor) -> torch.Tensor:
    return x.exp().sin().sum() * x


def _longer(x: torch.Tensor) -> torch.Tensor:
    return _narrow(x).sin().cos()


def test_recompute_mismatch_error_is_torchs_checkpoint_error() -> None:
    assert issubclass(remat.RecomputeMismatchError, CheckpointError)
    assert issubclass(remat.RecomputeMismatchError, remat.RematError)
    assert issubclass(remat.RecomputeMismatchError, RuntimeError)


@pytest.mark.parametrize("form", ["checkpoint", "decorator"])
def test_other_metadata_uses_torchs_words_then_the_site_and_advice(form: str) -> None:
    assert METADATA in _torch_error(_counted(_narrow, _wide))
    fn = _counted(_narrow, _wide)
    x = randn(4, requires_grad=True)

    def run() -> None:
        if form == "checkpoint":
            out = remat.checkpoint(fn, x, use_reentrant=False)
        else:
            out = remat.remat(name="block")(fn)(x)
        out.sum().backward()

    message = _remat_error(run)
    assert message.startswith("remat: " + METADATA)
    assert "tensor at position 1:\nsaved metadata: {'shape': torch.Size([4])" in message
    assert "recomputed metadata: {'shape': torch.Size([8])" in message
    site = "fn`" if form == "checkpoint" else "`block`"
    assert message.index(METADATA) < message.index(site) < message.index(ADVICE)


def test_more_tensors_uses_torchs_words_then_the_site_and_advice() -> None:
    assert MORE in _torch_error(_counted(_narrow, _longer), early_stop=False)
    fn = _counted(_narrow, _longer)
    x = randn(4, requires_grad=True)

    def run() -> None:
        remat.checkpoint(fn, x, use_reentrant=False, early_stop=False).sum().backward()

    message = _remat_error(run)
    assert message.startswith("remat: " + MORE)
    assert message.index(MORE) < message.index("fn`") < message.index(ADVICE)


def test_fewer_tensors_uses_torchs_words_then_the_site_and_advice() -> None:
    assert COUNT in _torch_error(_counted(_longer, _narrow))
    fn = _counted(_longer, _narrow)
    x = randn(4, requires_grad=True)

    def run() -> None:
        remat.checkpoint(fn, x, use_reentrant=False).sum().backward()

    message = _remat_error(run)
    assert message.startswith("remat: " + COUNT)
    assert message.index(COUNT) < message.index("fn`") < message.index(ADVICE)



DEBUG = "You are seeing this error because you passed `debug=True` to checkpoint"


def _torch_debug_error(fn: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """torch's message for `fn` when its checkpoint runs with `debug=True`."""
    with pytest.raises(CheckpointError) as info:
        out = torch.utils.checkpoint.checkpoint(fn, randn(4, requires_grad=True), use_reentrant=False, debug=True)
        out.sum().backward()
    return str(info.value)


def test_torchs_checkpoint_says_the_debug_sentence() -> None:  # the baseline for the test below
    assert DEBUG in _torch_debug_error(_counted(_narrow, _wide))


@pytest.mark.parametrize("turned_on", ["keyword", "torch switch"])
def test_a_mismatch_under_debug_says_torchs_debug_sentence_above_the_traces(turned_on: str) -> None:
    fn = _counted(_narrow, _wide)
    x = randn(4, requires_grad=True)

    def run() -> None:
        if turned_on == "keyword":
            out = remat.checkpoint(fn, x, use_reentrant=False, debug=True)
        else:
            with torch.utils.checkpoint.set_checkpoint_debug_enabled(True):
                out = remat.checkpoint(fn, x, use_reentrant=False)
        out.sum().backward()

    message = _remat_error(run)
    assert message.startswith("remat: " + METADATA)
    assert message.index(ADVICE) < message.index(DEBUG) < message.index("Op traces (REMAT_DEBUG=1):")


def test_torchs_debug_sentence_is_left_out_without_debug() -> None:
    fn = _counted(_narrow, _wide)
    x = randn(4, requires_grad=True)
    message = _remat_error(lambda: remat.checkpoint(fn, x, use_reentrant=False).sum().backward())
    assert DEBUG not in message and "Op traces" not in message
