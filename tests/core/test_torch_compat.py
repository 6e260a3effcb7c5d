"""remat without the private torch names newer than its floor, and torch's global hook tables left as they were.

Each private name `remat/_core/torch_compat.py` binds with a fallback is deleted from torch in a fresh process before
`import remat`; a rematerialized function (rerun), a region (replay) and a model under `remat.apply` with a
buffer must then give the gradients of the same code without remat, and must have recomputed.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

import remat
from remat._core.torch_compat import GlobalModuleHooks

ROOT = Path(__file__).resolve().parents[2]

# What a torch older than 2.13 (and at least 2.4) may lack; see remat/_core/torch_compat.py.
NEWER = [
    "torch._C._get_graph_exec_group",
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "torch._C._autograd._get_current_graph_task_keep_graph",
    "torch._C._is_any_autocast_enabled",
    "torch._C._storage_id",
    "torch._C._accelerator_getAccelerator",
    "torch.compiler.set_stance",
    "torch.utils.checkpoint._CachingTorchDispatchMode",
]

SCRIPT = r"""
import sys, importlib
import torch
owner, _, attr = sys.argv[1].rpartition(".")
parts = owner.split(".")
obj = importlib.import_module(parts[0])
for part in parts[1:]:
    obj = getattr(obj, part)
if sys.argv[2] == "delete":
    delattr(obj, attr)
    assert not hasattr(obj, attr)
else:  # "no-argument": the early form of a function that now takes one flag
    original = getattr(obj, attr)
    setattr(obj, attr, lambda: original(False))

import remat
from remat._engine import stats
from torch import nn
from torch.testing import assert_close

torch.manual_seed(0)
x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
calls = []

def body(x, w):
    calls.append(1)
    return ((x @ w).tanh() @ w).sin()

def grads(run):
    for t in (x, w):
        t.grad = None
    run().sum().backward()
    return x.grad.clone(), w.grad.clone()

expected = grads(lambda: body(x, w))
calls.clear()
assert_close(grads(lambda: remat(body)(x, w)), expected)
assert len(calls) == 2, calls  # forward, then recompute in backward

def in_region():
    with remat.region():
        return body(x, w)

before = stats.recomputes
assert_close(grads(in_region), expected)
assert stats.recomputes > before

def model():
    torch.manual_seed(1)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()) for _ in range(2)]).double()

plain, remade = model(), remat.apply(model())
plain(x).sum().backward()
before = stats.recomputes
remade(x).sum().backward()
assert stats.recomputes > before
for (name, a), b in zip(plain.state_dict().items(), remade.state_dict().values()):
    assert_close(a, b, msg=name)  # running statistics updated once
for a, b in zip(plain.parameters(), remade.parameters()):
    assert_close(a.grad, b.grad)

before = stats.tiles  # token-wise work in tiles (remat/_engine/tiles.py)
expected = grads(lambda: (x @ w).tanh())
assert_close(grads(lambda: remat.tiled(lambda t: (t @ w).tanh(), x, dim=0, tiles=3)), expected)
assert stats.tiles == before + 3
print("ok")
"""


def _run(name: str, how: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, name, how], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.slow  # a fresh interpreter per missing name: NOTE [ Slow tests ] in tests/conftest.py
@pytest.mark.parametrize("name", NEWER)
def test_remat_works_without(name: str) -> None:
    _run(name, "delete")


@pytest.mark.slow  # a fresh interpreter: NOTE [ Slow tests ] in tests/conftest.py
def test_remat_works_with_the_early_form_of_the_hook_stack_query() -> None:
    _run("torch._C._autograd._top_saved_tensors_default_hooks", "no-argument")


def _tables() -> list[dict[int, object]]:
    return [
        dict(torch_module._global_forward_pre_hooks),
        dict(torch_module._global_forward_hooks),
        dict(torch_module._global_forward_hooks_always_called),
    ]


def test_offload_and_recompute_leave_torch_global_hook_tables_as_they_were() -> None:
    before = _tables()
    layer = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    outer = remat.offload(include_cpu=True)
    with outer:
        assert len(torch_module._global_forward_pre_hooks) == len(before[0]) + 1  # buffers are watched inside
        with remat.offload(include_cpu=True), outer:  # nested, and the same object entered twice
            y = remat.remat(layer)(x).sum()
        assert len(torch_module._global_forward_pre_hooks) == len(before[0]) + 1
    assert _tables() == before
    y.backward()  # the recompute's buffer guard installs its hooks and takes them out again
    assert _tables() == before


def test_offload_blocks_on_several_threads_leave_the_tables_as_they_were() -> None:
    before = _tables()
    start = threading.Barrier(4)

    def work() -> None:
        start.wait()
        for _ in range(50):
            with remat.offload(include_cpu=True):
                nn.Linear(2, 2)(torch.randn(1, 2))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert _tables() == before


def test_an_offload_block_that_raises_leaves_the_tables_as_they_were() -> None:
    before = _tables()
    with pytest.raises(ZeroDivisionError), remat.offload(include_cpu=True):
        _ = 1 / 0
    assert _tables() == before


@pytest.mark.parametrize("private", [True, False])
def test_global_module_hooks_both_ways(private: bool) -> None:
    before = _tables()
    seen: list[str] = []
    hooks = GlobalModuleHooks(-0x7E57, lambda m, a: seen.append("pre"), lambda m, a, o: seen.append("post"))
    if not private:
        hooks._tables = None  # as on a torch without the private tables: the public registration
    hooks.install()
    with pytest.raises(RuntimeError, match="boom"):
        _Raises()(torch.zeros(1))
    nn.Identity()(torch.zeros(1))
    hooks.remove()
    nn.Identity()(torch.zeros(1))
    assert seen == ["pre", "post", "pre", "post"]  # the forward hook runs also when forward raises
    assert _tables() == before


class _Raises(nn.Module):
    def forward(self, x: torch.Tensor) -> None:
        raise RuntimeError("boom")
