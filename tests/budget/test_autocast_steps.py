"""Steps under autocast, planned as they run: each step's forward in an autocast region of its own (autocast caches
the casts of the weights until its region ends), for the estimate's configurations and the budget's profile, and a
budget planned under one autocast state and trained under another planned again (NOTE [ A step's own autocast
region ] in remat/_measure/step_autocast.py, NOTE [ Planned under autocast ] in remat/_budget/driver.py).

The baseline is a real step as torch's AMP recipe writes it: forward and loss in `torch.autocast`, backward outside.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import recomputes
from torch import nn

import remat
from tests.models import Workload, build

pytest.importorskip("transformers")

CONFIGS = ("none", "full", "save_matmuls")


@pytest.fixture(scope="module")
def llama() -> Workload:
    return build("llama")  # four layers


def _bf16() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _state(work: Workload) -> int:
    tensors = [*work.model.parameters(), *work.model.buffers(), *(v for v in work.sample.values())]
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def _configured(work: Workload, config: str) -> nn.Module:
    model = copy.deepcopy(work.model)
    if config == "full":
        remat.apply(model)
    elif config == "save_matmuls":
        remat.apply(model, policy=remat.policies.save_matmuls)
    return model


def _step(model: nn.Module, work: Workload) -> int:
    """The tracked peak of one real step in its own autocast region (gradients made by backward counted)."""
    for p in model.parameters():
        p.grad = None
    with remat.track() as t:
        with _bf16():
            loss = model(**work.sample).loss
        loss.backward()
        del loss
    return t.peak_bytes


@pytest.mark.slow  # every configuration estimated and run under autocast: NOTE [ Slow tests ] in tests/conftest.py
def test_estimates_under_autocast_match_a_step_in_its_own_region_whatever_else_is_estimated(llama: Workload) -> None:
    measured = {}
    for config in CONFIGS:
        with remat.enabled(config != "none"):
            measured[config] = _state(llama) + _step(_configured(llama, config), llama)
    with _bf16():
        together = remat.estimate(llama.model, llama.sample, configs=(*CONFIGS, 0.5))
        alone = {config: remat.estimate(llama.model, llama.sample, configs=(config,))[config] for config in
                 (*CONFIGS, 0.5)}
        assert torch.is_autocast_enabled("cpu")  # the caller's region is as it was
    for config in (*CONFIGS, 0.5):
        assert together[config].peak_bytes == alone[config].peak_bytes, config
    for config in CONFIGS:
        assert abs(together[config].peak_bytes / measured[config] - 1) < 0.05, (config, together[config],
                                                                               measured[config])
    float32 = remat.estimate(llama.model, llama.sample, configs=("none",))["none"]
    assert together["none"].activation_bytes < 0.75 * float32.activation_bytes  # autocast was on in the steps


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_a_budget_planned_under_autocast_holds_from_its_first_step(llama: Workload) -> None:
    with remat.enabled(False):
        none = _step(llama.model, llama)
    model = copy.deepcopy(llama.model)
    with _bf16():
        remat.apply(model, budget=0.5, sample=llama.sample)
    plan = remat.plan(model).budget
    assert plan is not None and plan.budget <= 0.5 * none
    before = recomputes()
    peaks = [_step(model, llama) for _ in range(3)]
    assert recomputes() > before
    assert all(peak <= 1.05 * plan.budget for peak in peaks), (peaks, plan.budget)
    assert abs(plan.peak_bytes / peaks[0] - 1) < 0.05, (plan.peak_bytes, peaks[0])


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "remat"]


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_a_budget_planned_without_autocast_plans_again_at_the_first_step_under_it(
        llama: Workload, caplog: pytest.LogCaptureFixture) -> None:
    model = copy.deepcopy(llama.model)
    remat.apply(model, budget=0.5, sample=llama.sample)
    planned = remat.plan(model).budget
    with caplog.at_level(logging.WARNING, logger="remat"):
        peaks = [_step(model, llama) for _ in range(3)]
    assert [m for m in _messages(caplog) if "autocast" in m] == [
        "remat: the budgeted LlamaForCausalLM was planned without autocast and trains autocast (cpu bfloat16): "
        "planning again for this step."]
    plan = remat.plan(model).budget
    assert planned is not None and plan is not None and plan.budget < planned.budget  # 0.5 of the bf16 step's
    assert all(peak <= 1.05 * plan.budget for peak in peaks), (peaks, plan.budget)


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_replan_false_keeps_the_plan_and_warns_once(llama: Workload) -> None:
    model = copy.deepcopy(llama.model)
    remat.apply(model, budget=0.5, sample=llama.sample, replan=False)
    planned = remat.plan(model).budget
    with pytest.warns(UserWarning, match="planned without autocast and trains autocast"):
        _step(model, llama)
    _step(model, llama)  # said once
    assert remat.plan(model).budget is not None and remat.plan(model).budget.budget == planned.budget


def test_the_caller_s_autocast_cache_setting_is_the_steps() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(256, 256)
    model = nn.Sequential(layer, nn.ReLU(), layer)  # one weight used twice: cast once when the region caches
    x = torch.randn(8, 256)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.float().sum()

    with _bf16():
        cached = remat.estimate(model, x, loss=loss, configs=("none",))["none"]
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        uncached = remat.estimate(model, x, loss=loss, configs=("none",))["none"]
    assert uncached.peak_bytes - cached.peak_bytes >= 256 * 256 * 2  # the weight cast twice, not once
