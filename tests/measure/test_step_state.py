"""A measured step leaves the model's buffers as it found them, copying only those it writes (NOTE [ Buffers a measured
step writes ] in remat/_measure/state.py), in eager code and where the user compiled the blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat._measure.step_peak import measure_step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 32))
                           for _ in range(2)])


def _check(model: nn.Module) -> None:
    x = torch.randn(64, 32)
    before = [b.clone() for b in model.buffers()]
    assert measure_step(model, lambda: model(x).square().mean()) > 0
    assert all(torch.equal(now, old) for now, old in zip(model.buffers(), before, strict=True))


def test_the_statistics_a_step_writes_are_put_back() -> None:
    _check(_model())


@pytest.mark.slow  # compiles two blocks: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's own imports
def test_the_statistics_compiled_blocks_write_are_put_back() -> None:
    """AOTAutograd writes a compiled graph's mutations of its inputs back with ops a dispatch mode sees."""
    torch._dynamo.reset()
    try:
        model = _model()
        for block in model.children():
            block.compile()
        model(torch.randn(64, 32)).sum().backward()  # compiled before the measured step
        model.zero_grad(set_to_none=True)
        _check(model)
    finally:
        torch._dynamo.reset()
