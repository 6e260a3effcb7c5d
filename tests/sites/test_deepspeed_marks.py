"""The DeepSpeed integration in one process, without DeepSpeed: its marks are read by name (NOTE [ Budgets under
DeepSpeed ZeRO ] in remat/_sites/integrations/deepspeed.py), so a model that carries them by hand stands in for
one an engine owns. The runs under a real engine, 2 gloo ranks, are tests/sites/test_deepspeed.py."""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat._measure.step_tracker import StepTracker
from remat._sites.integrations import engine_of
from remat._sites.integrations.deepspeed import DeepSpeed

WIDTH, BLOCKS = 32, 4


def _in_module(name: str, source: str) -> dict[str, Any]:
    """The functions of `source`, defined as if in the module `name` (their frames and `__module__` say so)."""
    namespace: dict[str, Any] = {"__name__": name, "torch": torch}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace


ZERO = _in_module("deepspeed.runtime.zero.stage3", """
def gather(n):
    return torch.ones(n)

def reduce(param):
    param.bucket = param.grad.clone()

def backward(loss):
    loss.backward()

def pre_forward(module, args):
    raise AssertionError("a DeepSpeed hook ran on the fake twin")
""")
LINEAR = _in_module("deepspeed.runtime.zero.linear", """
def linear(x, w):
    return x @ w
""")


@pytest.fixture
def deepspeed_loaded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`deepspeed` in sys.modules, as where the user imported it (a stand-in module: nothing of it is used)."""
    monkeypatch.setitem(sys.modules, "deepspeed", sys.modules.get("deepspeed") or types.ModuleType("deepspeed"))
    yield


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).sum()


def _partitioned(model: nn.Module) -> nn.Module:
    """`model` as ZeRO-3 leaves it on a rank: every parameter empty, its shape in `ds_shape`, DeepSpeed's hooks on
    every module (here they raise: nothing of remat's may run them)."""
    for i, p in enumerate(model.parameters()):
        p.ds_shape, p.ds_id = p.shape, i  # type: ignore[attr-defined]
        p.data = torch.empty(0)
    for module in model.modules():
        module.register_forward_pre_hook(ZERO["pre_forward"])
    return model


@pytest.mark.slow  # starts a subprocess: NOTE [ Slow tests ] in tests/conftest.py
def test_a_model_without_marks_has_no_engine_and_deepspeed_is_never_imported() -> None:
    """Without deepspeed in the process, a budget asks nothing more than a dictionary lookup: it never imports
    deepspeed, nor the integration."""
    code = (
        "import sys, torch, remat\n"
        "from remat._sites.integrations import engine_of\n"
        "model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), "
        "torch.nn.Linear(256, 64)) for _ in range(4)])\n"
        "assert engine_of(model) is None\n"
        "remat.apply(model, budget=0.7, sample=torch.randn(512, 64))\n"
        "loss = model(torch.randn(512, 64)).sum(); loss.backward()\n"
        "print(sorted(m for m in sys.modules if m == 'deepspeed' or m.endswith('integrations.deepspeed')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_marks_are_read_by_name(deepspeed_loaded: None) -> None:
    plain = Net()
    assert engine_of(plain) is None
    assert engine_of(_partitioned(Net())) == DeepSpeed(partitioned=True, hands_over=True)
    reduced = Net()
    for p in reduced.parameters():
        p.register_post_accumulate_grad_hook(ZERO["reduce"])  # ZeRO-2's gradient reduction
    assert engine_of(reduced) == DeepSpeed(partitioned=False, hands_over=True)


def test_a_partitioned_model_is_planned_on_full_shapes_without_a_real_step(deepspeed_loaded: None) -> None:
    """Every parameter is empty and every module carries a hook that raises: a budget still plans (on the fake
    twin, full shapes, no hook), leaves the model as it was, and its check waits for the first training step."""
    model = _partitioned(Net())
    tables = [(m, m._forward_pre_hooks, dict(m._forward_pre_hooks)) for m in model.modules()]
    remat.apply(model, budget=0.5, sample=torch.randn(8, 64, WIDTH))
    plan = remat.plan(model).budget
    assert plan is not None and plan.measured is None
    assert any(plan.choices[c] != "kept" for c in plan.choice), plan
    plain = remat.plan(remat.apply(Net(), budget=0.5, sample=torch.randn(8, 64, WIDTH))).budget
    assert plain is not None and plan.budget < plain.budget  # no remat's peak without the gradients kept
    for module, table, entries in tables:  # the same tables, the same hooks, in order
        assert module._forward_pre_hooks is table
        assert [k for k in table if k in entries] == list(entries)
    assert all(p.numel() == 0 and hasattr(p, "ds_shape") for p in model.parameters())


def test_the_engines_own_allocations_are_set_apart() -> None:
    """What DeepSpeed's ZeRO runtime allocates is set apart, by the code that allocates it; its `linear` computes
    the model's matmuls, and what autograd allocates in a backward DeepSpeed called is the step's."""
    w = torch.randn(256, 256, requires_grad=True)
    w.register_post_accumulate_grad_hook(ZERO["reduce"])
    x = torch.randn(64, 256)
    activation, weight = 64 * 256 * 4, 256 * 256 * 4
    with StepTracker(DeepSpeed.allocating) as tracker:
        gathered = ZERO["gather"](100_000)  # 400 kB, the engine's, freed at once
        del gathered
        h = LINEAR["linear"](x, w)  # the model's
        ZERO["backward"](h.sum())  # w.grad (the step's) and its copy in the bucket (the engine's)
        assert tracker.apart_bytes == weight  # the bucket
        del w.bucket  # type: ignore[attr-defined]
        assert tracker.apart_bytes == 0
        live = tracker.current_bytes
    assert tracker.apart_peak == 100_000 * 4  # the gathered tensor, then the bucket (smaller)
    assert live == activation + weight  # h and w.grad
    assert activation + weight <= tracker.peak_bytes < activation + 2 * weight


def test_the_trainers_loss_keyword_changes_no_signature() -> None:
    from remat._measure.sample import signature

    x = torch.zeros(2, 8, dtype=torch.long)
    assert signature((), {"input_ids": x}) == signature((), {"input_ids": x, "num_items_in_batch": torch.tensor(9)})
    assert signature((), {"input_ids": x}) != signature((), {"input_ids": x, "logits_to_keep": 1})


def test_a_compiled_plan_of_an_engines_model_is_refused(deepspeed_loaded: None) -> None:
    """`compile=True` verifies on real compiled steps, which the engine would see: a clear error instead."""
    model = _partitioned(Net())
    with pytest.raises(ValueError, match=r"compile=True.*DeepSpeed ZeRO-3 would see them"):
        remat.apply(model, budget=0.5, sample=torch.randn(8, 64, WIDTH), compile=True)
    assert remat.plan(model).budget is None


def test_the_engine_itself_is_refused(deepspeed_loaded: None) -> None:
    """A budget is for the model the engine runs (`engine.module`), not for DeepSpeed's engine module around it."""
    engine_class = type("DeepSpeedEngine", (nn.Module,), {"__module__": "deepspeed.runtime.engine"})
    engine = engine_class()
    engine.module = _partitioned(Net())
    with pytest.raises(ValueError, match=r"DeepSpeedEngine.*engine\.module"):
        remat.apply(engine, budget=0.5, sample=torch.randn(8, 64, WIDTH))
