"""Planning again on a new input shape inside a user's forward is never silent: logged once per model or chain."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import remat


def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]).double()


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "remat"]


def test_a_budgeted_model_logs_its_first_replan_once(caplog: pytest.LogCaptureFixture) -> None:
    model = remat.apply(_stack(), nn.Sequential, budget=1.0, sample=torch.randn(4, 8, dtype=torch.float64))
    with caplog.at_level(logging.WARNING, logger="remat"):
        model(torch.randn(4, 8, dtype=torch.float64)).sum().backward()  # the planned shape: nothing to say
        assert _messages(caplog) == []
        for batch in (6, 7):
            model(torch.randn(batch, 8, dtype=torch.float64)).sum().backward()
    assert len(_messages(caplog)) == 1
    assert "new input shapes" in _messages(caplog)[0] and "replan=False" in _messages(caplog)[0]


def test_a_replan_for_a_new_dtype_says_so(caplog: pytest.LogCaptureFixture) -> None:
    model = remat.apply(_stack(), nn.Sequential, budget=1.0, sample=torch.randn(4, 8, dtype=torch.float64))
    model.float()
    with caplog.at_level(logging.WARNING, logger="remat"):
        model(torch.randn(4, 8)).sum().backward()
    assert len(_messages(caplog)) == 1 and "inputs of a new dtype or device" in _messages(caplog)[0]


def test_replan_false_neither_plans_nor_logs(caplog: pytest.LogCaptureFixture) -> None:
    model = remat.apply(_stack(), nn.Sequential, budget=1.0, sample=torch.randn(4, 8, dtype=torch.float64),
                        replan=False)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="remat"):
        model(torch.randn(6, 8, dtype=torch.float64)).sum().backward()
    assert _messages(caplog) == []


def test_a_chain_logs_its_first_new_shape_once(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    chain = remat.chain(list(_stack()), budget=1.0, sample=x)
    with caplog.at_level(logging.WARNING, logger="remat"):
        chain(x).sum().backward()
        assert _messages(caplog) == []
        for batch in (6, 7):
            chain(torch.randn(batch, 8, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert len(_messages(caplog)) == 1 and "new input shape (6, 8)" in _messages(caplog)[0]
