"""Profiles on fake tensors are priced, not timed (NOTE [ Priced time ] in remat/_measure/clock.py).

On fake tensors the wall clock reads only Python, so plans made on it changed with the machine's load; priced
time makes them the same on every run. Each test that the price is independent of the clock slows every block
by a sleep: on the wall clock that changes every time the profile reports (the last test shows it does).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import remat
from remat._budget.driver import BudgetHook
from remat._budget.solve import Assignment
from remat._chain.stages import profile_stages
from remat._demo import GPT, GPTConfig
from remat._measure import clock
from remat._measure.clock import OpClock, now, price, priced

CFG = GPTConfig(blocks=4, d=64, heads=2, seq=32, batch=2, vocab=256, dropout=0.0)
aten = torch.ops.aten


def _idx() -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (CFG.batch, CFG.seq), generator=torch.Generator().manual_seed(0))


def _slowed(model: nn.Module, blocks: list[nn.Module], sleep: float) -> None:
    for block in blocks:
        block.register_forward_pre_hook(lambda *_: time.sleep(sleep))


def _plan(model: nn.Module) -> Assignment:
    hooks = [h for h in model._forward_pre_hooks.values() if isinstance(h, BudgetHook)]
    assert len(hooks) == 1 and hooks[0].assignment is not None
    return hooks[0].assignment


def _budget_on_fake(sleep: float, budget: float = 0.9) -> Assignment:
    with FakeTensorMode():
        model = GPT(CFG)
        _slowed(model, list(model.blocks), sleep)
        remat.apply(model, budget=budget, sample=_idx())
        return _plan(model)


# the nominal CPU of NOTE [ Priced time ]: 8e10 FLOP/s, 5e10 bytes/s, 1e9 elements/s without a FLOP formula,
# 5 us per op
LAUNCH = 5e-6


def test_price_is_flops_elements_or_bytes_plus_a_launch_on_the_nominal_cpu() -> None:
    a, b = torch.ones(64, 128), torch.ones(128, 32)
    flops, moved = 2 * 64 * 128 * 32, (64 * 128 + 128 * 32 + 64 * 32) * 4
    assert price(aten.mm.default, (a, b), {}, a @ b) == pytest.approx(LAUNCH + max(flops / 8e10, moved / 5e10))
    x = torch.ones(1 << 20)
    assert price(aten.add.Tensor, (x, x), {}, x + x) == pytest.approx(LAUNCH + (1 << 20) / 1e9)
    y = torch.ones(1 << 16, 64)  # a reduction: few elements out, many bytes read
    moved = 4 * ((1 << 22) + (1 << 16))
    assert price(aten.sum.dim_IntList, (y, [1]), {}, y.sum(1)) == pytest.approx(LAUNCH + moved / 5e10)
    assert price(aten.view.default, (x, [2, -1]), {}, x.view(2, -1)) == pytest.approx(LAUNCH)  # a view: its launch
    assert price(aten.sym_size.int, (x, 0), {}, 1 << 20) == 0.0  # no tensor out: nothing ran
    with FakeTensorMode():  # a fake tensor costs what a real one of its device would
        f = torch.ones(64, 128)
        assert price(aten.mm.default, (f, f.t()), {}, f @ f.t()) == pytest.approx(LAUNCH + 2 * 64 * 128 * 64 / 8e10)


def test_without_torchs_flop_formulas_a_matmul_is_priced_by_its_elements(monkeypatch: pytest.MonkeyPatch) -> None:
    a = torch.ones(256, 256)
    with_formula = price(aten.mm.default, (a, a), {}, a @ a)
    monkeypatch.setattr("remat._core.torch_compat._flop_formulas", lambda: {})
    without = price(aten.mm.default, (a, a), {}, a @ a)
    assert without == pytest.approx(LAUNCH + 256 * 256 / 1e9)
    assert without < with_formula


def test_cpu_attention_is_priced_by_torchs_attention_formula() -> None:
    q = torch.ones(2, 2, 128, 64)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    flops = 4 * 2 * 2 * 128 * 128 * 64  # two matmuls of (128 x 64) by (64 x 128) per head
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert price(op, (q, q, q), {}, (out,)) == pytest.approx(LAUNCH + flops / 8e10)


def test_a_budget_on_fake_tensors_is_planned_on_prices_not_on_the_clock() -> None:
    plain, slowed = _budget_on_fake(0.0), _budget_on_fake(0.005)
    assert plain.cost == slowed.cost, "every time in the profile is the same, sleeps or not"
    assert plain.choice == slowed.choice
    assert any(plain.choices[c] != "kept" for c in plain.choice), "remat was active"
    assert not priced() and not _get_current_dispatch_mode_stack(), "no clock or mode left behind"


def test_an_estimates_budget_row_is_the_same_on_every_run() -> None:
    with torch.device("meta"):
        model = GPT(CFG)
    rows = [remat.estimate(model, _idx(), configs=(0.9,))[0.9] for _ in range(2)]
    _slowed(model, list(model.blocks), 0.005)
    rows.append(remat.estimate(model, _idx(), configs=(0.9,))[0.9])
    assert rows[0].peak_bytes == rows[1].peak_bytes == rows[2].peak_bytes
    none = remat.estimate(model, _idx(), configs=("none",))["none"]
    assert rows[0].peak_bytes < none.peak_bytes, "remat was active"


def test_a_chain_profiled_on_fake_tensors_is_priced() -> None:
    def stages(sleep: float) -> list[nn.Module]:
        out: list[nn.Module] = [nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)]
        _slowed(nn.Module(), out, sleep)
        return out

    with FakeTensorMode():
        x = torch.randn(16, 32)
        plain, slowed = profile_stages(stages(0.0), x), profile_stages(stages(0.005), x)
    assert plain == slowed
    assert all(cost.forward_time > 0 and cost.backward_time > 0 for cost in plain[0])


def test_real_tensors_are_timed_on_the_wall_clock() -> None:
    x = torch.randn(16, 32)
    stages = [nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2)]
    _slowed(nn.Module(), stages, 0.005)
    slowed = profile_stages(stages, x)[0]
    # each block's forward holds its sleep, which only the wall clock sees (a price would not): a lower bound that
    # holds however loaded the machine is
    assert all(s.forward_time >= 0.004 for s in slowed)
    start = now()
    time.sleep(0.002)
    assert now() - start >= 0.002 and not priced()


def test_an_op_clock_is_taken_off_on_an_exception() -> None:
    with pytest.raises(RuntimeError, match="inside"), OpClock() as outer:
        torch.ones(4) + 1
        assert priced() and now() == outer.seconds > 0
        raise RuntimeError("inside")
    assert not priced() and not clock._clocks and not _get_current_dispatch_mode_stack()
