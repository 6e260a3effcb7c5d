"""torch.compile over remat-decorated code (docs/guides/compile.md): gradients equal eager, nothing breaks the graph."""

from __future__ import annotations

import functools
import shutil
from typing import Any

import pytest
import torch
from conftest import CountOps, randn
from models import MLP
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's own notes about C builtins


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def test_a_compiled_model_of_rematerialized_functions_matches_eager() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(8, 8).double()

    @remat
    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(layer(x)).sin()

    def model(x: torch.Tensor) -> torch.Tensor:
        return block(block(x)).sum()

    x = randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(model(x), (x, layer.weight))
    compiled = torch.compile(model, backend="aot_eager")
    got = torch.autograd.grad(compiled(x), (x, layer.weight))
    torch.testing.assert_close(got, expected)
    assert torch._dynamo.explain(model)(x).graph_break_count == 0


def test_a_compiled_rematerialized_instance_matches_eager() -> None:
    torch.manual_seed(0)
    model = remat.apply(nn.Sequential(MLP(), MLP()).double(), MLP)
    x = randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(model(x).sum(), x)
    got = torch.autograd.grad(torch.compile(model, backend="aot_eager")(x).sum(), x)
    torch.testing.assert_close(got, expected)


def test_the_checkpoint_drop_in_under_compile_matches_eager() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(8, 8).double()

    def model(x: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(lambda h: torch.tanh(layer(h)), x, use_reentrant=False).sum()

    x = randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(model(x), (x, layer.weight))
    got = torch.autograd.grad(torch.compile(model, backend="aot_eager")(x), (x, layer.weight))
    torch.testing.assert_close(got, expected)
    assert torch._dynamo.explain(model)(x).graph_break_count == 0


def test_a_region_inside_compiled_code_gives_eager_gradients() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(8, 8).double()

    def model(x: torch.Tensor) -> torch.Tensor:
        with remat.region():
            h = torch.tanh(layer(x)).sin()
        return (h * 2).sum()

    x = randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(model(x), (x, layer.weight))
    got = torch.autograd.grad(torch.compile(model, backend="aot_eager")(x), (x, layer.weight))
    torch.testing.assert_close(got, expected)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's own imports
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler"))])
def test_a_compiled_model_that_keeps_a_random_op_matches_eager(backend: str) -> None:
    """NOTE [ Random ops ] in remat/_engine/rng.py, under compile: a site keeping a random op (tests/seeded.py) and a
    dropout after it. The partitioner saves what the site's selective context keeps and replays each recomputed
    random op from a state of its own (`functionalize_rng_ops`), so no stream shifts; inductor draws as eager code
    with `fallback_random`."""
    from seeded import keeps_noisy, noisy_scale

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.nn.functional.dropout(torch.tanh(noisy_scale(self.fc1(x), 0.3)), 0.5)
            return self.fc2(h)  # type: ignore[no-any-return]

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(Noisy(), Noisy()).double()

    def step(model: nn.Module, call: nn.Module) -> tuple[Any, ...]:
        torch.manual_seed(1)
        grads = torch.autograd.grad(call(x).sum(), (x, *model.parameters()))
        return (*grads, torch.get_rng_state())

    x = randn(4, 8, requires_grad=True)
    expected = step(plain := make(), plain)
    model = remat.apply(make(), Noisy, policy=remat.policies.save_matmuls | keeps_noisy)
    previous = torch._inductor.config.fallback_random
    torch._inductor.config.fallback_random = True
    try:
        got = step(model, torch.compile(model, backend=backend))
    finally:
        torch._inductor.config.fallback_random = previous
    torch.testing.assert_close(got, expected)


def _scaled(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Issue 51's first row: a matmul output the policy keeps, changed in place after the matmul."""
    h = x @ w1
    h.mul_(2)
    return (h.sin() @ w2).cos()


def _scaled_scores(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Attention's scores, scaled in place: the matmul's output is a `bmm`'s, seen through an `_unsafe_view` with a
    version counter of its own (rule 7 of NOTE [ A kept output changed in place ] in remat/_engine/kept.py)."""
    q = (x @ w1).view(2, 2, 2, 16)
    s = q @ q.transpose(-1, -2)
    s /= 4.0
    return (s.softmax(-1) @ q).reshape(8, 16) @ w2


def _keep_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("function", [_scaled, _scaled_scores], ids=["mm", "bmm through an _unsafe_view"])
@pytest.mark.parametrize("site", ["@remat save_matmuls", "checkpoint, torch's selective contexts"])
@pytest.mark.parametrize("backend", [pytest.param("eager", marks=pytest.mark.equivalence), "aot_eager"])
def test_a_kept_output_changed_in_place_under_compile(backend: str, site: str, function: Any) -> None:
    """Compiled code functionalises the change and saves the op's own value; where torch runs its checkpoint operator
    eagerly (`backend="eager"`), the recompute mode runs the changed matmul again (one more in backward than no
    remat's) where torch raised "Tensor cached during selective activation checkpoint has been mutated" (NOTE
    [ Under torch.compile ], rule 4)."""
    if site == "@remat save_matmuls":
        fn = remat.remat(function, policy=remat.policies.save_matmuls)
    else:
        context_fn = functools.partial(create_selective_checkpoint_contexts, _keep_mm)
        fn = functools.partial(remat.checkpoint, function, use_reentrant=False, context_fn=context_fn)

    def grads(run: Any) -> tuple[tuple[torch.Tensor, ...], int]:
        args = (randn(8, 16, requires_grad=True), randn(16, 16, requires_grad=True, seed=1),
                randn(16, 16, requires_grad=True, seed=2))
        out = run(*args).sum()
        with CountOps(lambda func: func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)) as counter:
            found = torch.autograd.grad(out, args)
        return found, counter.count

    expected, plain = grads(function)
    got, matmuls = grads(torch.compile(fn, backend=backend, fullgraph=True))
    torch.testing.assert_close(got, expected)
    if backend == "eager":
        assert matmuls == plain + 1
