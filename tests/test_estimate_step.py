"""`remat.estimate` against the training loop users write, on tiny GPT-2: the step's peak as the device sees it.

The baseline is a real step, independent of the estimator: gradients set to None before it (as
`optimizer.zero_grad()` leaves them), `loss = model(**batch).loss; loss.backward()` under `remat.track()` (the
model's output is dropped once the loss is computed, so the logits die when backward starts), and whole AdamW
loops under `remat.track(limit=...)`: a device of the predicted size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import remat
from remat.bench.estimate import hf_case
from tests.conftest import recomputes

pytest.importorskip("transformers")
pytestmark = pytest.mark.ignores_switch  # the estimate and the real steps set the switch per configuration

CONFIGS = ("none", "full")


def _case() -> tuple[torch.nn.Module, dict[str, Any]]:
    case = hf_case("gpt2", tiny=True, seq=64, batch=2, device="cpu")  # `python -m remat --model estimate`'s
    return case.model, case.sample


def _before(model: torch.nn.Module, sample: dict[str, Any]) -> int:
    """Bytes live when a step begins before the optimizer's first step: parameters, buffers, the batch."""
    tensors = [*model.parameters(), *model.buffers(), *(v for v in sample.values() if isinstance(v, torch.Tensor))]
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def _configured(config: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    model, sample = _case()
    if config == "full":
        remat.apply(model)
    return model, sample


def _real_step_peak(config: str) -> int:
    """The peak of forward and backward above what was live when the step began, gradients made by backward."""
    model, sample = _configured(config)
    for p in model.parameters():
        p.grad = None
    before = recomputes()
    with remat.enabled(config != "none"), remat.track() as t:
        loss = model(**sample).loss
        loss.backward()
    assert (recomputes() > before) == (config == "full"), "full remat recomputed, no remat did not"
    return t.peak_bytes


def test_the_fwd_bwd_peak_of_tiny_gpt2_matches_a_real_step() -> None:
    model, sample = _case()
    report = remat.estimate(model, sample, configs=CONFIGS)  # no optimizer: the step is forward and backward
    measured = {config: _real_step_peak(config) for config in CONFIGS}
    for config in CONFIGS:
        row = report[config]
        predicted = row.step_peak_bytes - _before(model, sample)  # above what the step starts with
        assert predicted / measured[config] == pytest.approx(1.0, abs=0.01), (config, predicted, measured)
    assert measured["full"] < 0.6 * measured["none"], "remat was active"


@pytest.mark.parametrize("config", CONFIGS)
def test_an_adamw_loop_fits_a_device_of_the_predicted_size_and_not_one_5_percent_smaller(config: str) -> None:
    """The promise of §2.9 as a device sees it: the whole step (optimizer state made in the first step)."""
    model, sample = _case()
    predicted = remat.estimate(model, sample, optimizer="adamw", configs=(config,))[config].peak_bytes

    def loop(limit: int) -> None:
        model, sample = _configured(config)
        with remat.enabled(config != "none"), remat.track(limit=limit - _before(model, sample)):
            optimizer = torch.optim.AdamW(model.parameters())
            for _ in range(3):
                optimizer.zero_grad()
                loss = model(**sample).loss
                loss.backward()
                optimizer.step()

    loop(predicted)
    with pytest.raises(torch.OutOfMemoryError, match=r"^remat: out of memory on cpu"):
        loop(int(predicted * 0.95))
