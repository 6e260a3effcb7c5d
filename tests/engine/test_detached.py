"""Detached tensors (docs/design.md, 'What remat guarantees' 4): `.detach()`, `no_grad` blocks, integer tensors,
inputs not requiring grad, parameters only, outputs not requiring grad."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint
from conftest import assert_same_grads, randn, recomputes
from models import MLP, ConvBN, TransformerBlock
from torch import nn

import remat


def test_detach_inside_the_site() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = (x @ w).tanh()
        scale = h.detach().abs().mean()  # a constant for autograd
        return (h / scale).sin() + h.detach().exp()

    assert_same_grads(lambda: fn, (randn(4, 6, requires_grad=True), randn(6, 6, requires_grad=True, seed=1)))


def test_no_grad_block_inside_the_site() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            norm = (x @ w).norm(dim=-1, keepdim=True)
        h = (x @ w).sin() / norm
        with torch.enable_grad():
            h = h.exp()
        return h

    assert_same_grads(lambda: fn, (randn(4, 6, requires_grad=True), randn(6, 6, requires_grad=True, seed=1)))


def test_site_called_under_no_grad_is_a_plain_call() -> None:
    fn = remat.remat(lambda x: x.sin().exp())
    x = randn(4, requires_grad=True)
    with torch.no_grad():
        y = fn(x)
    assert not y.requires_grad
    torch.testing.assert_close(y, x.detach().sin().exp())


def test_integer_tensors_in_and_out() -> None:
    def fn(x: torch.Tensor, index: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        picked = x.exp().gather(1, index) * mask
        return picked.sin(), picked.argmax(dim=1)

    inputs = (
        randn(4, 5, requires_grad=True),
        torch.tensor([[0, 2], [1, 1], [4, 3], [2, 0]]),
        torch.tensor([[1, 0], [1, 1], [0, 1], [1, 1]], dtype=torch.int32),
    )
    _, ours = assert_same_grads(lambda: fn, inputs)
    assert ours.out[1].dtype == torch.int64 and not ours.out[1].requires_grad


def test_some_inputs_not_requiring_grad() -> None:
    def fn(x: torch.Tensor, frozen: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return ((x @ w).tanh() * frozen.exp()).sin()

    inputs = (randn(4, 6), randn(4, 6, seed=1), randn(6, 6, requires_grad=True, seed=2))
    _, ours = assert_same_grads(lambda: fn, inputs)
    assert ours.grads.keys() == {"input 0"}  # only w required grad


@pytest.mark.parametrize("make", [MLP, TransformerBlock, ConvBN])
def test_parameters_only_frozen_input_and_trainable_parameters(make: type[nn.Module]) -> None:
    """No input requires grad, the parameters do: remat gives every parameter gradient."""
    x = {MLP: randn(4, 8), TransformerBlock: randn(2, 5, 8), ConvBN: randn(2, 3, 5, 5)}[make]
    _, ours = assert_same_grads(make, (x,))
    assert ours.grads and all(grad is not None for grad in ours.grads.values())
    assert all(grad.abs().sum() > 0 for grad in ours.grads.values())


def test_reentrant_torch_checkpoint_drops_parameter_grads_where_remat_does_not() -> None:
    """The trap remat fixes: `use_reentrant=True` with a frozen input gives no parameter gradient."""
    torch.manual_seed(0)
    model = MLP().double()
    x = randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that none of the inputs require grad
        out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=True)
    assert not out.requires_grad  # so nothing flows to the parameters
    for wrap in (remat.remat, lambda m: lambda x: remat.checkpoint(m, x, use_reentrant=True)):
        _, ours = assert_same_grads(MLP, (x,), wrap)
        assert ours.grads["parameter fc1.weight"] is not None


def test_outputs_not_requiring_grad() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sin().exp(), (x.detach() * 2).cos()

    x = randn(4, requires_grad=True)
    a, b = remat.remat(fn)(x)
    assert a.requires_grad and not b.requires_grad and b.grad_fn is None
    assert_same_grads(lambda: fn, (x,))


def test_nothing_requires_grad() -> None:
    fn = remat.remat(lambda x: x.sin().exp())
    y = fn(randn(4))
    assert not y.requires_grad
    torch.testing.assert_close(y, randn(4).sin().exp())


def test_detached_input_from_a_graph() -> None:
    """A tensor that is the detached output of an earlier graph is treated like any non-leaf input."""

    def fn(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (h @ w).sin().exp()

    w = randn(6, 6, requires_grad=True, seed=1)
    h = (randn(4, 6, requires_grad=True) * 2).detach()
    assert_same_grads(lambda: fn, (h, w))


@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_inference_tensors_as_plain_autograd_takes_them(strategy: str) -> None:
    """A tensor made under `torch.inference_mode()` has no version counter: an input that autograd never saves, and
    a buffer made in inference mode, run as without remat (rerun raised "Inference tensors do not track version
    counter" at the call); an input autograd would save raises torch's own error."""
    with torch.inference_mode():
        made = randn(4, 6)
    base_model = nn.Linear(6, 6).double()
    with torch.inference_mode():
        base_model.register_buffer("shift", randn(6, seed=2))

    def fn(model: nn.Module, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (model(w) + x + model.shift).tanh()  # the addition saves neither `x` nor the buffer

    w = randn(4, 6, requires_grad=True, seed=1)
    fn(base_model, made, w).sum().backward()
    expected, w.grad = w.grad, None
    before = recomputes()
    ours = remat.remat(base_model, strategy=strategy)
    remat.remat(lambda x, w: fn(ours, x, w), strategy=strategy)(made, w).sum().backward()
    assert recomputes() > before
    torch.testing.assert_close(w.grad, expected)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        remat.remat(lambda x: (x * w).sum(), strategy=strategy)(made)  # `mul` saves `x`
    h = w * 1.0
    loss = remat.remat(lambda x, h: (x + h).tanh().sum(), strategy=strategy)(made, h)
    h.add_(1)  # the other input changed in place: named, beside the inference tensor
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
