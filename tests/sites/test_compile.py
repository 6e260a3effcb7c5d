"""torch.compile over remat-decorated code (docs/guides/compile.md): gradients equal eager, nothing breaks the graph."""

from __future__ import annotations

import pytest
import torch
from conftest import randn
from models import MLP
from torch import nn

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
