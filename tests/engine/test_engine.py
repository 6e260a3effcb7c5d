"""The saved-tensor-hook engine (docs/design.md, 'Saved-tensor hooks', 'Early stop'; 'What remat guarantees' 2 and
6): memory held for backward, early stop, freeing, the autograd API (retain_graph, autograd.grad, create_graph,
output hooks), nesting, views of outside tensors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_grads, randn
from models import MLP, Cell, TransformerBlock, TwoConv
from torch import nn

import remat
from remat._engine import stats as _stats
from remat._measure.track import track


def recomputes() -> int:
    return _stats.recomputes


# -- memory held for backward -----------------------------------------------------------------------------
def test_tutorial_loop_holds_about_one_hundredth_of_the_memory() -> None:
    """The tutorial's example: 100 `x = x * a` ops per call, the call chained; remat keeps only inputs."""
    a = randn(16, seed=1).requires_grad_()

    def body(x: torch.Tensor) -> torch.Tensor:
        for _ in range(100):
            x = x * a
        return x

    held, grads = [], []
    for fn in (body, remat.remat(body)):
        x = randn(16, requires_grad=True)
        with track() as t:
            y = x
            for _ in range(40):  # 40 chained calls keep the test fast; the ratio does not depend on it
                y = fn(y)
            held.append(t.current_bytes)
        y.sum().backward()
        grads.append((x.grad, a.grad.clone()))
        a.grad = None
    plain, ours = held
    assert plain == 40 * 100 * 16 * 8  # every intermediate x is saved by the mul that uses it
    assert ours == 40 * 16 * 8  # each call's output, which is the next call's input
    assert 90 <= plain / ours <= 110
    torch.testing.assert_close(grads[1], grads[0])


def test_held_bytes_are_at_most_the_inputs() -> None:
    """After forward, a site on a transformer block holds no more than its input and its output (docs/design.md,
    'What remat guarantees' 2)."""
    block = TransformerBlock().double()
    x = randn(2, 5, 8, requires_grad=True)
    with track() as t:
        out = block(x)
        plain = t.current_bytes
    del out
    remat.remat(block)
    with track() as t:
        out = block(x)
        ours = t.current_bytes
    assert ours <= out.untyped_storage().nbytes() + 2 * 5 * 8 * 8  # output, plus at most one input-sized tensor
    assert ours * 5 < plain


def test_two_convolutions_with_the_second_rematerialized() -> None:
    """The tutorial's model with conv2 wrapped in `remat.checkpoint`, as its `checkpoint(self.conv2, x)`."""

    def second_conv_checkpointed(model: TwoConv) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            return remat.checkpoint(lambda h: model.conv2(h).relu(), F.relu(model.conv1(x))).relu()

        return run

    _, ours = assert_same_grads(TwoConv, (randn(2, 1, 8, 8, requires_grad=True),), second_conv_checkpointed)
    assert ours.grads["parameter conv2.weight"] is not None


# -- early stop and freeing -------------------------------------------------------------------------------
def test_recompute_stops_after_the_last_needed_tensor() -> None:
    """Early stop raises out where forward saved something after the last needed tensor (NOTE [ Early stop ])."""
    reached: list[str] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.sin().cos()  # cos saves sin's output: the last tensor backward needs
        reached.append("tail")
        h.exp()  # saves its output, but the result is dropped: nothing needs it
        return h * 2.0  # a scalar mul saves nothing

    x = randn(5, requires_grad=True)
    remat.remat(fn)(x).sum().backward()
    assert reached == ["tail"], "recompute ran past the last needed tensor"
    reached.clear()
    remat.checkpoint(fn, x, early_stop=False).sum().backward()
    assert reached == ["tail", "tail"]
    torch.testing.assert_close(x.grad, 2 * 2 * -torch.sin(x.sin()) * x.cos())


def test_the_outcome_of_early_stop_never_depends_on_timing() -> None:
    """A recompute that saves more after the last needed tensor: tolerated with early stop, an error without.

    Forward here takes a few microseconds; 0.1.0 stopped early only after a forward of 100 µs and so raised.
    """
    calls: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        h = x.sin().cos()
        if len(calls) % 2 == 0:  # recompute: more work after the last needed tensor
            h = h + h.exp().exp().sum() * 0
        return h

    for _ in range(20):
        x = randn(5, requires_grad=True)
        remat.checkpoint(fn, x, use_reentrant=False).sum().backward()
        torch.testing.assert_close(x.grad, -torch.sin(x.sin()) * x.cos())
        with pytest.raises(remat.RecomputeMismatchError, match="saved more tensors than forward"):
            remat.checkpoint(fn, x, use_reentrant=False, early_stop=False).sum().backward()


def test_a_recompute_that_saves_fewer_tensors_raises_without_early_stop() -> None:
    calls: list[int] = []

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        h = x.sin().exp()
        return h @ w if len(calls) % 2 else h * 2.0  # forward's mm saves w; recompute does not

    x, w = randn(3, 3, requires_grad=True), randn(3, 3, seed=1)
    with pytest.raises(remat.RecomputeMismatchError, match="fewer tensors"):
        remat.checkpoint(fn, x, w, use_reentrant=False, early_stop=False).sum().backward()


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(x)))


def _other_parameters(model: nn.Module, kind: str) -> dict[str, torch.Tensor]:
    if kind == "frozen":  # frozen weights given as other tensors
        for block in model:
            block.inner.weight.requires_grad_(False)
        return {f"{i}.inner.weight": block.inner.weight * 2 for i, block in enumerate(model)}
    params = dict(model.named_parameters())
    if kind == "computed":  # fast weights, MAML's inner step
        return {name: p * 2 for name, p in params.items()}
    if kind == "leaves":
        return {name: (p.detach() * 2).requires_grad_() for name, p in params.items()}
    return {name: nn.Parameter(p.detach() * 2) for name, p in params.items()}


@pytest.mark.parametrize("kind", ["computed", "leaves", "parameters", "frozen"])
def test_a_forward_with_other_parameters_is_a_mismatch_under_rerun_and_exact_under_replay(kind: str) -> None:
    """NOTE [ Parameters in recompute ]: `torch.func.functional_call` runs the module with other tensors in place of
    its parameters; rerun would recompute with the module's own, silently (the gradients off by 0.3 to 0.6, as
    torch.utils.checkpoint's; a frozen one's, rule 2, gave an input gradient off by 1.02)."""
    from torch.func import functional_call

    torch.manual_seed(0)
    base = nn.Sequential(_Residual(), _Residual()).double()
    x = torch.randn(4, 8, dtype=torch.float64)

    def gradients(model: nn.Module) -> list[torch.Tensor]:
        others = _other_parameters(model, kind)
        leaf = x.clone().requires_grad_()
        functional_call(model, others, (leaf,)).pow(2).sum().backward()
        given = kind in ("leaves", "parameters")
        leaves = others.values() if given else [p for p in model.parameters() if p.requires_grad]
        return [leaf.grad, *(p.grad for p in leaves)]  # type: ignore[list-item]

    expected = gradients(base)
    for strategy in ("rerun", "replay"):
        torch.manual_seed(0)
        model = nn.Sequential(_Residual(), _Residual()).double()
        for block in model:
            remat(block, strategy=strategy)
        before = recomputes()
        if strategy == "rerun":
            with pytest.raises(remat.RecomputeMismatchError, match="functional_call"):
                gradients(model)
            continue
        got = gradients(model)
        assert recomputes() > before
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b)


def test_parameters_frozen_or_given_as_inputs_are_no_mismatch() -> None:
    """NOTE [ Parameters in recompute ], rule 2: a frozen parameter is rebuilt; a parameter given to a site as its
    input is recomputed from a copy."""


    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(4, 8))
            self.block = _Residual()
            self.block.inner.weight.requires_grad_(False)

        def forward(self) -> torch.Tensor:
            return self.block(self.table)

    assert_same_grads(Table, (), lambda model: (remat(model.block), model)[1])


class _Probe(torch.autograd.Function):
    """Identity whose backward records what a callback returns at that moment."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, record: Callable[[], None]) -> torch.Tensor:
        ctx.record = record  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.record()  # type: ignore[attr-defined]
        return grad, None


def test_each_rebuilt_tensor_is_freed_once_unpacked() -> None:
    """Halfway through backward, the rebuilt activations of the half already done are gone."""
    n, size = 20, 1000 * 8
    seen: list[int] = []
    tracker = track()

    def chain(x: torch.Tensor) -> torch.Tensor:
        for index in range(n):
            x = x.exp() * 0.5 if index != n // 2 else _Probe.apply(x, lambda: seen.append(tracker.current_bytes))
        return x

    x = randn(1000, requires_grad=True)
    y = remat.remat(chain)(x * 0.01)
    with tracker:
        y.sum().backward()
    assert len(seen) == 1
    # All n-1 exp outputs are rebuilt at once; by the probe the upper half has been used and freed. Allow the
    # gradient buffers in flight (a few tensors) on top of the lower half that is still waiting.
    assert seen[0] <= (n // 2 + 4) * size, seen
    assert seen[0] >= (n // 2 - 1) * size, "the lower half must still be there"
    assert tracker.current_bytes <= 2 * size  # after backward: x.grad and at most one temporary


# -- autograd API -----------------------------------------------------------------------------------------
def _backward_twice(loss: torch.Tensor, leaves: list[torch.Tensor]) -> None:
    loss.backward(retain_graph=True)
    loss.backward()


def test_retain_graph_backward_twice_recomputes_twice() -> None:
    before = recomputes()
    assert_same_grads(MLP, (randn(4, 8, requires_grad=True),), backward=_backward_twice)  # gradients doubled
    assert recomputes() - before == 2


def _autograd_grad(loss: torch.Tensor, leaves: list[torch.Tensor]) -> None:
    for leaf, grad in zip(leaves, torch.autograd.grad(loss, leaves), strict=True):
        leaf.grad = grad


def test_autograd_grad_matches_baseline() -> None:
    inputs = (randn(3, 2, 6, requires_grad=True), (randn(2, 6, requires_grad=True), randn(2, 6, seed=1)))
    from models import Unrolled

    assert_same_grads(Unrolled, inputs, lambda m: remat.apply(m, Cell), backward=_autograd_grad)


def test_autograd_grad_with_a_subset_of_inputs() -> None:
    def first_only(loss: torch.Tensor, leaves: list[torch.Tensor]) -> None:
        (leaves[0].grad,) = torch.autograd.grad(loss, [leaves[0]])

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x.sin() * y.cos()).exp()

    inputs = (randn(5, requires_grad=True), randn(5, requires_grad=True, seed=1))
    _, ours = assert_same_grads(lambda: fn, inputs, backward=first_only)
    assert ours.grads["input 1"] is None and ours.grads["input 0"] is not None


def test_backward_with_inputs_a_subset_of_parameters() -> None:
    def only_fc2(loss: torch.Tensor, leaves: list[torch.Tensor]) -> None:
        loss.backward(inputs=[leaf for leaf in leaves if leaf.shape == (16, 16)])

    _, ours = assert_same_grads(MLP, (randn(4, 8, requires_grad=True),), backward=only_fc2)
    assert ours.grads["parameter fc2.weight"] is not None and ours.grads["parameter fc1.weight"] is None


def test_create_graph_double_backward() -> None:
    def gradient_penalty(loss: torch.Tensor, leaves: list[torch.Tensor]) -> None:
        grads = torch.autograd.grad(loss, leaves, create_graph=True)
        sum((g * g).sum() for g in grads).backward()

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).sin() @ w.t()

    inputs = (randn(4, 6, requires_grad=True), randn(6, 6, requires_grad=True, seed=1))
    assert_same_grads(lambda: fn, inputs, backward=gradient_penalty)
    assert_same_grads(
        lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Softplus()),
        (randn(4, 6, requires_grad=True),), backward=gradient_penalty,
    )


# -- nesting ----------------------------------------------------------------------------------------------
def test_nested_decorated_functions() -> None:
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x.sin().exp()

    def outer_with(wrapped_inner: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
        def outer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return wrapped_inner(torch.tanh(x @ w)).cos() @ w

        return outer

    inputs = (randn(4, 6, requires_grad=True), randn(6, 6, requires_grad=True, seed=1))
    before = recomputes()
    assert_same_grads(lambda: outer_with(inner), inputs, lambda fn: remat.remat(outer_with(remat.remat(inner))))
    assert recomputes() - before >= 2  # the outer site and the inner one both rebuilt something


def test_nested_module_sites() -> None:
    def nested(model: nn.Module) -> nn.Module:
        remat.apply(model, (nn.LayerNorm, nn.Sequential))
        return remat.remat(model)

    assert_same_grads(TransformerBlock, (randn(2, 5, 8, requires_grad=True),), nested)


def test_nested_sites_hold_no_more_than_the_outer_inputs() -> None:
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x.exp().exp()

    def outer(x: torch.Tensor) -> torch.Tensor:
        return inner(inner(x.sin()).cos()).tanh()

    x = randn(1000, requires_grad=True)
    with track() as t:
        y = remat.remat(outer)(x)
        held = t.current_bytes
    assert held == y.untyped_storage().nbytes()  # the nested inputs are activations of the outer site


# -- views of outside tensors -----------------------------------------------------------------------------
def test_views_of_outside_tensors_are_kept_not_rebuilt() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.t()  # mm saves x and the transposed weight: both come from outside

    inputs = (randn(4, 6, requires_grad=True), randn(5, 6, requires_grad=True, seed=1))
    before = recomputes()
    assert_same_grads(lambda: fn, inputs, expect_recompute=False)
    assert recomputes() == before, "a view of an input was rebuilt instead of kept"


def test_transposed_parameter_is_kept() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(6, 6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.T @ self.weight.T

    x = randn(4, 6, requires_grad=True)
    model = remat.remat(Tied().double())
    with track() as t:
        y = model(x)
        held = t.current_bytes
    # the intermediate x @ W.T is rebuilt; W.T (a view of the parameter) costs nothing
    assert held == y.untyped_storage().nbytes()
    assert_same_grads(Tied, (x,))


# -- hooks on outputs -------------------------------------------------------------------------------------
class Hooked(nn.Module):
    """A body whose output gets a tensor hook that doubles its gradient and records it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        y.register_hook(lambda grad: self.seen.append(grad) or grad * 2)
        return y.tanh()


def test_tensor_hooks_on_outputs() -> None:
    def body_rematerialized(model: Hooked) -> Hooked:
        remat.remat(model.body)
        return model

    base, ours = assert_same_grads(Hooked, (randn(4, 8, requires_grad=True),), body_rematerialized)
    assert len(ours.target.seen) == 1
    torch.testing.assert_close(ours.target.seen[0], base.target.seen[0])


def test_module_backward_hooks_on_a_rematerialized_instance() -> None:
    grads: dict[str, list[torch.Tensor]] = {"plain": [], "remat": []}

    def hooked(label: str) -> Callable[[nn.Module], nn.Module]:
        def wrap(model: nn.Module) -> nn.Module:
            model.register_full_backward_hook(lambda module, gin, gout: grads[label].append(gout[0]))
            return remat.remat(model) if label == "remat" else model

        return wrap

    x = (randn(4, 8, requires_grad=True),)
    base, ours = assert_same_grads(MLP, x, hooked("remat"))
    hooked("plain")(base.target)
    base.target(x[0]).sum().backward()
    ours.target(x[0]).sum().backward()
    assert len(grads["remat"]) == 2 and len(grads["plain"]) == 1
    torch.testing.assert_close(grads["remat"][1], grads["plain"][0])


@pytest.mark.parametrize("strategy_model", [MLP, TransformerBlock])
def test_output_used_twice_and_partially(strategy_model: type[nn.Module]) -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = strategy_model()

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.body(x)
            return y.sum(-1), y[..., :2].exp()

    x = randn(2, 5, 8, requires_grad=True) if strategy_model is TransformerBlock else randn(4, 8, requires_grad=True)
    assert_same_grads(TwoHeads, (x,), lambda m: (remat.remat(m.body), m)[1])


def test_sites_inside_other_saved_tensor_hooks() -> None:
    """Inside `save_on_cpu` (or any user hooks) a site hands its inputs to those hooks and gets them back."""

    def under_save_on_cpu(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        remat.apply(model, (nn.LayerNorm, nn.Sequential))

        def run(x: torch.Tensor) -> torch.Tensor:
            with torch.autograd.graph.save_on_cpu():
                return model(x)

        return run

    assert_same_grads(TransformerBlock, (randn(2, 5, 8, requires_grad=True),), under_save_on_cpu)


def test_double_backward_through_nested_sites() -> None:
    def penalty(loss: torch.Tensor, leaves: list[torch.Tensor]) -> None:
        grads = torch.autograd.grad(loss, leaves, create_graph=True)
        sum((g * g).sum() for g in grads).backward()

    def nested(model: nn.Module) -> nn.Module:
        remat.apply(model, (nn.LayerNorm, nn.Softplus))
        remat.remat(model[2])
        return remat.remat(model)

    def make() -> nn.Module:
        inner = nn.Sequential(nn.Linear(8, 8), nn.Softplus(), nn.LayerNorm(8))
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), inner, nn.Tanh())

    assert_same_grads(make, (randn(2, 3, 8, requires_grad=True),), nested, backward=penalty)


@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_a_long_chain_of_sites_is_freed_without_recursion(strategy: str) -> None:
    """Dropping 20000 chained sites once crashed the C stack (see NOTE [ Freeing long chains ])."""
    site = remat.remat(lambda x, a: (x * a).sin() * a, strategy=strategy)  # type: ignore[call-overload]
    a = torch.full((4,), 1.5, requires_grad=True)
    x = torch.ones(4, requires_grad=True)
    for _ in range(20_000):
        x = site(x, a)
    x.sum().backward()
    assert a.grad is not None
    del x


class _Noisy(nn.Module):
    """Noise in training only, from an op that autograd saves nothing of (so a recompute in eval mode saves what
    forward saved, of the same shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.training:
            h = h + 0.5 * torch.randn_like(h)
        return h.tanh()


@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_a_mode_switched_between_forward_and_backward(strategy: str) -> None:
    """NOTE [ Recompute state ], rule 4: `model.eval()` before backward made rerun recompute without the noise,
    and the gradients were off by 0.7, silently; replay replays forward's ops."""
    torch.manual_seed(0)
    plain = nn.Sequential(_Noisy(), _Noisy()).double()
    model = nn.Sequential(_Noisy(), _Noisy()).double()
    model.load_state_dict(plain.state_dict())
    for block in model:
        remat(block, strategy=strategy)
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.manual_seed(1)
    plain(x).pow(2).sum().backward()
    torch.manual_seed(1)
    loss = model(x).pow(2).sum()
    model.eval()
    if strategy == "rerun":
        with pytest.raises(remat.RecomputeMismatchError, match=r"training mode in forward and is in eval mode now"):
            loss.backward()
        return
    before = recomputes()
    loss.backward()
    assert recomputes() > before
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)
