"""The global switch (docs/guides/sites.md, 'The switch'; docs/design.md, 'What remat guarantees' 10): `REMAT`,
`set_enabled`/`is_enabled`/`enabled`, per-site `enabled=`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_same_grads, hooks_installed, randn
from models import MLP
from torch import nn

import remat
from remat._core.switch import parse_flag
from remat._engine import stats as _stats


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "On", "yes", " YES ", "", None])
def test_on_values(value: str | None) -> None:
    assert parse_flag("REMAT", value, True) is True


@pytest.mark.parametrize("value", ["0", "false", "False", "OFF", "no", " 0 "])
def test_off_values_including_zero(value: str) -> None:
    assert parse_flag("REMAT", value, True) is False


@pytest.mark.parametrize("value", ["2", "enabled", "y", "-1", "none"])
def test_invalid_value_names_the_variable_value_and_choices(value: str) -> None:
    with pytest.raises(ValueError, match=f"REMAT={value!r}") as info:
        parse_flag("REMAT", value, True)
    assert "1/true/on/yes" in str(info.value) and "0/false/off/no" in str(info.value)


def _start(code: str, **env: str) -> subprocess.Popen[str]:
    environment = {key: val for key, val in os.environ.items() if key not in ("REMAT", "REMAT_DEBUG")}
    environment.update(env)
    return subprocess.Popen(
        [sys.executable, "-c", code], env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


_PROBE = (
    "import torch, remat\n"
    "seen = []\n"
    "f = remat.remat(lambda x: seen.append("
    "torch._C._autograd._top_saved_tensors_default_hooks(False) is not None) or x.sin().exp())\n"
    "f(torch.ones(2, requires_grad=True)).sum().backward()\n"
    "print(remat.is_enabled(), seen)"
)


@pytest.mark.slow  # starts a subprocess: NOTE [ Slow tests ] in tests/conftest.py
def test_environment_variable_read_at_import() -> None:
    """`REMAT=0` turns every site off (not `bool("0")`); a bad value fails the import. Both in subprocesses."""
    off = _start(_PROBE, REMAT="0")
    bad = _start("import remat", REMAT="maybe")
    out, err = off.communicate(timeout=120)
    assert out.strip() == "False [False]", err[-800:]
    _, err = bad.communicate(timeout=120)
    assert bad.returncode != 0
    assert "ValueError" in err and "REMAT='maybe'" in err, err[-800:]


def test_set_enabled_and_is_enabled() -> None:
    assert remat.is_enabled() is True
    remat.set_enabled(False)
    assert remat.is_enabled() is False and remat.remat.is_enabled() is False
    remat.set_enabled(True)
    assert remat.is_enabled() is True
    with pytest.raises(TypeError, match="bool"):
        remat.set_enabled(0)  # type: ignore[arg-type]


def test_enabled_context_restores_on_exit_and_on_error() -> None:
    with remat.enabled(False):
        assert not remat.is_enabled()
        with remat.enabled(True):
            assert remat.is_enabled()
        assert not remat.is_enabled()
    assert remat.is_enabled()
    with pytest.raises(KeyError), remat.enabled(False):
        raise KeyError
    assert remat.is_enabled()


def _probe() -> tuple[list[bool], Callable[[torch.Tensor], torch.Tensor]]:
    """A function that records whether saved-tensor hooks are installed while it runs."""
    seen: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(hooks_installed())
        return x.sin().exp()

    return seen, fn


class Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(hooks_installed())
        return self.fc(x).tanh().exp()


SITES: list[Any] = [
    pytest.param(lambda fn: remat.remat(fn), id="function"),
    pytest.param(lambda fn: lambda x: remat.checkpoint(fn, x), id="checkpoint"),
]


@pytest.mark.parametrize("make_site", SITES)
def test_switched_off_sites_are_pass_throughs(make_site: Callable[[Any], Any]) -> None:
    seen, fn = _probe()
    site = make_site(fn)
    x = randn(4, requires_grad=True)
    before = _stats.recomputes
    with remat.enabled(False):
        site(x).sum().backward()
    assert seen == [False] and _stats.recomputes == before
    site(x).sum().backward()  # on again: hooks while it runs, one recompute
    assert seen == [False, True, True] and _stats.recomputes == before + 1


def test_switched_off_module_sites_are_pass_throughs() -> None:
    model = remat.remat(Probe().double())
    with remat.enabled(False):
        model(randn(2, 4, requires_grad=True)).sum().backward()
    assert model.seen == [False]
    model(randn(2, 4, requires_grad=True)).sum().backward()
    assert model.seen == [False, True, True]


@pytest.mark.parametrize("variant", [remat.remat, lambda m: remat.apply(m, nn.Linear)])
def test_gradients_with_the_switch_off_equal_baseline(variant: Callable[[Any], Any]) -> None:
    with remat.enabled(False):
        assert_same_grads(MLP, (randn(4, 8, requires_grad=True),), variant, expect_recompute=False)


def test_per_site_enabled_overrides_the_switch() -> None:
    seen_on, fn_on = _probe()
    seen_off, fn_off = _probe()
    forced_on = remat.remat(enabled=True)(fn_on)
    forced_off = remat.remat(enabled=False)(fn_off)
    x = randn(4, requires_grad=True)
    with remat.enabled(False):
        (forced_on(x) + forced_off(x)).sum().backward()
    (forced_on(x) + forced_off(x)).sum().backward()
    assert seen_on == [True, True, True, True]  # forward and recompute, twice
    assert seen_off == [False, False]


def test_per_site_enabled_on_instances() -> None:
    model = remat.remat(Probe().double(), enabled=False)
    model(randn(2, 4, requires_grad=True)).sum().backward()
    assert model.seen == [False]
    with remat.enabled(False):
        forced = remat.remat(Probe().double(), enabled=True)
        forced(randn(2, 4, requires_grad=True)).sum().backward()
    assert forced.seen == [True, True]


def test_switch_is_read_at_call_time_not_decoration_time() -> None:
    seen, fn = _probe()
    with remat.enabled(False):
        site = remat.remat(fn)
    site(randn(4, requires_grad=True)).sum().backward()
    assert seen == [True, True]
