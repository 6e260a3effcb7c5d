"""The shared comparison helpers prove remat was active: with remat off they fail (see NOTE [ Equivalence tests
must fail without remat ] in conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_same_grads, randn, switches_kept
from models import MLP

import remat


def _chain(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp().tanh()


@pytest.mark.ignores_switch  # sets the switch itself
def test_the_helper_fails_when_remat_is_off() -> None:
    with remat.enabled(False), pytest.raises(AssertionError, match="recomputed nothing"):
        assert_same_grads(lambda: _chain, (randn(5, requires_grad=True),))
    with remat.enabled(False), pytest.raises(AssertionError, match="recomputed nothing"):
        assert_same_grads(MLP, (randn(4, 8, requires_grad=True),), remat.remat)


@pytest.mark.ignores_switch  # sets the switch itself
def test_the_helper_passes_when_remat_recomputes_and_when_told_nothing_will() -> None:
    with remat.enabled(True):
        assert_same_grads(lambda: _chain, (randn(5, requires_grad=True),))
    with remat.enabled(False):
        assert_same_grads(lambda: _chain, (randn(5, requires_grad=True),), expect_recompute=False)


@pytest.mark.ignores_switch  # sets the switch itself
def test_a_wrong_gradient_still_fails_the_helper() -> None:
    def wrong(fn: Any) -> Callable[..., torch.Tensor]:
        def call(x: torch.Tensor) -> torch.Tensor:
            return remat.remat(_chain)(x) * 1.001

        return call

    with pytest.raises(AssertionError):
        assert_same_grads(lambda: _chain, (randn(5, requires_grad=True),), wrong)



def test_a_switch_left_on_fails_the_test_and_is_put_back() -> None:
    """The guard every test runs under (`_no_state_left_behind`): a test that leaves autocast or grad mode on fails
    itself, and the tests after it start as they should (a CUDA test once left `set_sync_debug_mode("error")` on,
    and five tests after it failed for that alone)."""
    with pytest.raises(AssertionError, match="cpu autocast"), switches_kept():
        torch.set_autocast_enabled("cpu", True)
    assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(AssertionError, match="grad mode"), switches_kept():
        torch.set_grad_enabled(False)
    assert torch.is_grad_enabled()
    with switches_kept(), torch.autocast("cpu"), torch.no_grad():
        pass  # restored by the code itself: nothing to say
