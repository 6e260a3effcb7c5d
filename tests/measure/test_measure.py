"""Tests for remat._measure.measure: one forward and backward, measured with the tracker."""

from __future__ import annotations

import json
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat._core.units import format_bytes
from remat._measure.measure import measure
from remat._measure.measurement import Measurement, Report, format_seconds

F32 = 4


def _mlp(width: int = 64, depth: int = 4) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def test_held_bytes_of_a_known_function() -> None:
    x = torch.randn(1000, requires_grad=True)
    report = measure(lambda t: t.exp().exp(), x)
    # exp saves its result: the first exp's output is held; the second's is the output itself.
    assert report.held_bytes == 1000 * F32
    assert report.held_by_device == {"cpu": 1000 * F32}
    # Peak: both exps' outputs, then the gradient of the loss and x.grad during backward.
    assert report.peak_bytes >= 3 * 1000 * F32
    assert report.forward_seconds > 0 and report.backward_seconds > 0


def test_torch_checkpoint_drops_held_bytes() -> None:
    # Measuring works independently of remat's engine: torch's own checkpoint must show a drop.
    torch.manual_seed(0)
    mlp = _mlp()
    x = torch.randn(128, 64, requires_grad=True)

    def checkpointed(inp: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(mlp, inp, use_reentrant=False)
        return out

    plain = measure(mlp, x)
    ckpt = measure(checkpointed, x)
    # Without checkpointing, each Tanh output is held (4 layers, minus the output itself) and
    # each Linear's output is freed; with it, nothing made inside is held.
    assert plain.held_bytes == 3 * 128 * 64 * F32
    assert ckpt.held_bytes == 0
    assert ckpt.peak_bytes <= plain.peak_bytes


def test_output_structures_and_kwargs() -> None:
    def fn(x: torch.Tensor, *, scale: float) -> dict[str, Any]:
        return {"a": (x * scale).sin(), "b": [x.cos(), torch.arange(3)], "c": None}

    x = torch.randn(100, requires_grad=True)
    report = measure(fn, x, scale=2.0)
    assert report.held_bytes == 100 * F32  # x * scale, saved by sin
    assert x.grad is None


def test_scalar_output_is_backpropagated_as_is() -> None:
    w = torch.randn(10, requires_grad=True)
    report = measure(lambda t: (t * 3).sum(), w)
    assert report.held_bytes == 0  # mul by a Python scalar saves nothing
    assert w.grad is None


def test_existing_grads_are_put_back() -> None:
    mlp = _mlp(8, 1)
    before = {n: torch.full_like(p, 7.0) for n, p in mlp.named_parameters()}
    for n, p in mlp.named_parameters():
        p.grad = before[n].clone()
    measure(mlp, torch.randn(4, 8))
    for n, p in mlp.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(p.grad, before[n])


def test_output_without_grad_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"^remat: measure needs an output"):
        measure(lambda t: t * 2, torch.randn(3))
    with pytest.raises(TypeError, match=r"^remat: measure expects a function or module"):
        measure(3)  # type: ignore[arg-type]


def test_recompute_time_is_read_from_the_engine_counters() -> None:
    x = torch.randn(10, requires_grad=True)
    report = measure(lambda t: t.sin(), x)
    assert report.recompute_seconds == 0.0


def test_report_table_and_dict() -> None:
    run = Measurement("remat on", 2048, 1024, {"cpu": 2048}, {"cpu": 1024}, 0.5, 0.002, None)
    off = Measurement("remat off", 4096, 4096, {"cpu": 4096}, {"cpu": 4096}, 0.25, 0.001, 0.0)
    report = Report("Block", (run, off))
    text = str(report)
    lines = text.splitlines()
    assert lines[0] == "remat.measure: Block"
    assert len({len(line) for line in lines[1:3]}) == 1, "columns are aligned"
    assert "held for backward" in text and "0.25x" in text and "2.00x" in text
    assert report.ratios()["held_bytes"] == 0.25
    assert report.ratios()["recompute_seconds"] is None
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["runs"][1]["label"] == "remat off"
    assert report.peak_bytes == 2048 and report.recompute_seconds is None
    assert Report("single", (run,)).ratios() == {}


def test_formatting_helpers() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"
    assert format_seconds(None) == "-"
    assert format_seconds(2.5) == "2.50 s"
    assert format_seconds(0.0125) == "12.50 ms"
    assert format_seconds(3e-6) == "3.0 µs"


def _remat_or_skip() -> Callable[[nn.Module], nn.Module]:
    from remat._api import remat

    return remat


def test_compare_shows_remat_on_and_off() -> None:
    remat = _remat_or_skip()
    torch.manual_seed(0)
    # Two blocks of (Linear, Tanh, Linear, Tanh): without remat the four Tanh outputs but the last
    # are held; with it, only the first block's output (the second block's input).
    mlp = nn.Sequential(remat(_mlp(64, 2)), remat(_mlp(64, 2)))
    x = torch.randn(64, 64, requires_grad=True)
    report = measure(mlp, x, compare=True)
    on, off = report.runs
    assert (on.label, off.label) == ("remat on", "remat off")
    assert (on.held_bytes, off.held_bytes) == (64 * 64 * F32, 3 * 64 * 64 * F32)
    ratio = report.ratios()["held_bytes"]
    assert ratio is not None and ratio < 1
    assert "ratio" in str(report)


def test_compare_restores_rng_and_buffers_between_runs() -> None:
    _remat_or_skip()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
    x = torch.randn(16, 8, requires_grad=True)
    masks: list[torch.Tensor] = []
    net.register_forward_hook(lambda module, args, out: masks.append(out == 0))
    measure(net, x, compare=True)
    assert torch.equal(masks[0], masks[1]), "both runs see the same dropout mask"
    norm = net[1]
    assert isinstance(norm, nn.BatchNorm1d)
    tracked = norm.num_batches_tracked
    assert tracked is not None and int(tracked) == 1, "BatchNorm statistics updated once"


def test_compare_warms_up_both_sides_and_interleaves_them() -> None:
    from remat import is_enabled

    net = _mlp(32, 2)
    sides: list[bool] = []
    net.register_forward_hook(lambda module, args, out: sides.append(is_enabled()))
    report = measure(net, torch.randn(8, 32), compare=True)
    # One warm-up run each, then pairs in alternating order: neither side is always first.
    assert sides == [True, False, True, False, False, True, True, False]
    assert any("warm-up" in n for n in report.notes)
    assert any("no remat site" in n for n in report.notes), "a model with no site says so"
    assert "no remat site" in str(report)


def test_compare_does_not_charge_first_call_warm_up_to_one_side(monkeypatch: pytest.MonkeyPatch) -> None:
    # A model with no remat site whose first call is slow (lazy set-up): the sides run the same code, so their
    # forward times must agree, on the first call as on the second. The clock is the model's own (each forward
    # takes 1 s, the first 50 s), so the outcome does not depend on the machine: before warm-up, the first
    # side's median took the 50 s and the ratio was over 10x.
    from remat._measure import measure as measuring

    clock = [0.0]
    monkeypatch.setattr(measuring, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class Lazy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _mlp(256, 4)
            self.ready = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            clock[0] += 1.0 if self.ready else 50.0
            self.ready = True
            return self.inner(x)

    net = Lazy()
    x = torch.randn(64, 256)
    for _ in range(2):  # first and second call
        ratio = measure(net, x, compare=True).ratios()["forward_seconds"]
        assert ratio == 1.0, ratio
