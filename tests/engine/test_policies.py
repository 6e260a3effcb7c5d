"""Policies (docs/guides/policies.md): what a region keeps from forward, and that keeping it saves recompute."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import CountOps, assert_same_grads, randn, recomputes
from models import MLP, TransformerBlock
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import remat
from remat import policies
from remat._measure.track import track

POLICIES = {
    "save_nothing": policies.save_nothing,
    "save_all": policies.save_all,
    "save_matmuls": policies.save_matmuls,
    "save_tagged": policies.save_tagged("hidden"),
    "matmuls_or_tagged": policies.save_matmuls | policies.save_tagged("hidden"),
    "callable": lambda op: "tanh" in str(op),
}


class TaggedMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = remat.tag(torch.tanh(self.fc2(torch.relu(self.fc1(x)))), "hidden")
        return self.fc3(hidden)


def _site(strategy: str, policy: Any) -> Callable[[nn.Module], Callable[..., Any]]:
    """`remat(m, policy=...)` with a strategy, or the module's forward inside `remat.region(policy=...)`."""

    def wrap(model: nn.Module) -> Callable[..., Any]:
        if strategy != "region":
            return remat.remat(model, policy=policy, strategy=strategy)  # type: ignore[call-overload, no-any-return]

        def run(*args: Any) -> Any:
            with remat.region(policy=policy):
                return model(*args)

        return run

    return wrap


STRATEGIES = ["rerun", "replay", "region"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_gives_the_gradients_of_no_remat(name: str, strategy: str) -> None:
    """Every policy works with every strategy: the tape keeps a kept op's outputs too (NOTE
    [ Policies on the tape ] in remat/_engine/tape.py)."""
    assert_same_grads(
        TaggedMLP, (randn(4, 8, requires_grad=True),), _site(strategy, POLICIES[name]),
        expect_recompute=name != "save_all",
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", ["save_matmuls", "matmuls_or_tagged"])
def test_policies_on_a_transformer_block_with_dropout(name: str, strategy: str) -> None:
    assert_same_grads(TransformerBlock, (randn(2, 5, 8, requires_grad=True),), _site(strategy, POLICIES[name]))


def _backward_matmuls(policy: Any, strategy: str = "rerun") -> int:
    model = MLP().double()
    step = _site(strategy, policy)(model) if policy is not None else model
    loss = step(randn(4, 8, requires_grad=True)).sum()
    with CountOps(policies.Policy(ops=[remat._core.policies.matmuls]).saves_op) as counter:
        loss.backward()
    return counter.count


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_save_matmuls_runs_no_matmul_again_in_backward(strategy: str) -> None:
    plain = _backward_matmuls(None)
    assert _backward_matmuls(policies.save_nothing, strategy) > plain  # full remat reruns the layers' addmm
    assert _backward_matmuls(policies.save_matmuls, strategy) == plain


def _held_bytes(policy: Any, strategy: str = "rerun") -> int:
    model = TaggedMLP(64).double()
    step = _site(strategy, policy)(model) if policy is not None else model
    x = randn(32, 64, requires_grad=True)
    with track() as tracker:
        out = step(x)
        held = tracker.current_bytes
    out.sum().backward()
    return held


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_save_matmuls_holds_memory_between_full_remat_and_none(strategy: str) -> None:
    none, full = _held_bytes(None), _held_bytes(policies.save_nothing, strategy)
    matmuls = _held_bytes(policies.save_matmuls, strategy)
    # Outputs of matmuls are kept; pointwise ops between them are rebuilt. On an MLP whose pointwise
    # ops save their own outputs, that can hold as much as no remat, never more.
    assert full < matmuls <= none


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_tagged_tensor_is_kept_and_the_rest_rebuilt(strategy: str) -> None:
    full = _held_bytes(policies.save_nothing, strategy)
    tagged = _held_bytes(policies.save_tagged("hidden"), strategy)
    hidden_bytes = 32 * 128 * 8
    assert tagged - full == hidden_bytes


def test_tag_outside_a_region_is_the_identity() -> None:
    x = torch.ones(3)
    assert remat.tag(x, "anything") is x
    with pytest.raises(TypeError, match="tag expects a tensor"):
        remat.tag([1.0], "x")  # type: ignore[arg-type]


def test_policies_combine_with_or() -> None:
    policy = policies.save_matmuls | policies.save_tagged("a") | policies.save_tagged("b")
    assert policy.names == {"a", "b"}
    assert policy.saves_op(torch.ops.aten.mm.default)
    assert not policy.saves_op(torch.ops.aten.relu.default)
    assert repr(policies.save_nothing) == "save_nothing"


def test_a_bad_policy_is_a_type_error_when_decorating() -> None:
    with pytest.raises(TypeError, match=r"`policy` must be a callable or one of remat\.policies, but got `int`"):
        remat.remat(policy=3)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="save_tagged takes tag names"):
        policies.save_tagged(1)  # type: ignore[arg-type]


def test_retain_graph_backward_twice_with_a_policy() -> None:
    """A kept output that autograd does not save is dropped after the first recompute; the second reruns it."""

    def twice(loss: torch.Tensor, leaves: list[torch.Tensor]) -> None:
        loss.backward(retain_graph=True)
        loss.backward()

    for strategy in STRATEGIES:
        for policy in (policies.save_matmuls, policies.save_matmuls | policies.save_tagged("hidden")):
            assert_same_grads(TaggedMLP, (randn(4, 8, requires_grad=True),), _site(strategy, policy), backward=twice)


def _encoder(dropout: float) -> Callable[[], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]:
    def make() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
        layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=dropout, batch_first=True)
        model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        x = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(0))
        return model, lambda m: m(x).square().mean()

    return make


def _bench(kind: str) -> Callable[[], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]:
    from models import ChainNet, ChainNetConfig

    from remat._demo import GPT, BenchModel, ConvNet, ConvNetConfig, GPTConfig

    def make() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
        model: BenchModel
        if kind == "gpt":
            model = GPT(GPTConfig(blocks=3, d=32, heads=2, seq=32, batch=2, vocab=64))
        elif kind == "convnet":
            model = ConvNet(ConvNetConfig(width=4, blocks_per_stage=1, image=16, batch=2))
        else:
            model = ChainNet(ChainNetConfig(width=8, levels=(2, 2), image=16, batch=4))
        batch = model.sample(torch.device("cpu"))
        return model, lambda m: m.loss(*batch)  # type: ignore[operator]

    return make


MODELS = {
    "TransformerEncoder": _encoder(0.1),
    "TransformerEncoder without dropout": _encoder(0.0),
    "GPT": _bench("gpt"),
    "ConvNet": _bench("convnet"),
    "ChainNet": _bench("chain"),
}


def _peak(make: Callable[[], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]], policy: Any) -> int:
    """Peak bytes one training step adds beyond parameters and their (zero-filled) gradients."""
    torch.manual_seed(0)
    model, loss = make()
    if policy is not None:
        remat.apply(model, lambda name, m: name.count(".") == 1 and name.split(".")[0] in ("layers", "blocks"),
                    policy=policy)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(1)
    with track() as t:
        loss(model).backward()
    return t.peak_bytes


@pytest.mark.parametrize("name", list(MODELS))
def test_save_matmuls_peaks_between_full_remat_and_none(name: str) -> None:
    """0.1.0 peaked above no remat on nn.TransformerEncoder: kept matmul outputs outlived their recompute."""
    make = MODELS[name]
    none, full = _peak(make, None), _peak(make, policies.save_nothing)
    matmuls = _peak(make, policies.save_matmuls)
    assert full <= matmuls <= none, (full, matmuls, none)


@pytest.mark.equivalence
def test_a_kept_output_recompute_never_reaches_is_dropped_when_recompute_ends() -> None:
    # The last matmul feeds a residual add, so recompute stops once that matmul's input is saved and never
    # reaches the matmul whose output `save_matmuls` kept: that output must die when recompute ends, not stay
    # through the rest of the site's backward (full remat never holds it there).
    w1, w2 = randn(32, 128, requires_grad=True), randn(128, 32, requires_grad=True)
    last: list[StorageWeakRef] = []
    dead: list[bool] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        h = x @ w1
        if not last:  # forward only: once gelu's backward is done, the site's own backward is half-way
            h.register_hook(lambda grad: dead.append(last[0].expired()))
        y = torch.nn.functional.gelu(h) @ w2
        last.append(StorageWeakRef(y.untyped_storage()))
        return y + x

    x = randn(64, 32, requires_grad=True)
    expected = torch.autograd.grad(block(x).sum(), (x, w1, w2))
    assert dead == [True]  # without remat, y died with the forward
    last.clear()
    dead.clear()
    out = remat.remat(block, policy=policies.save_matmuls)(x)
    before = recomputes()
    got = torch.autograd.grad(out.sum(), (x, w1, w2))
    assert recomputes() == before + 1 and len(last) == 1  # recompute ran, and stopped before the last matmul
    assert dead == [True]
    torch.testing.assert_close(got, expected)


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_a_kept_output_autograd_saves_dies_once_the_ops_that_read_it_in_backward_have_run(strategy: str) -> None:
    # `save_matmuls` keeps h, which gelu saves. Without remat h dies once gelu's backward has run, while the rest of
    # the block's backward (the first matmul's) runs on; held by the site, it lived until the site's graph died: a
    # block's MLP outputs through its attention's backward (NOTE [ What a policy keeps ], rule 2).
    w1, w2 = randn(32, 128, requires_grad=True), randn(128, 32, requires_grad=True)
    kept: list[StorageWeakRef] = []
    dead: list[bool] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        h = x @ w1
        kept.append(StorageWeakRef(h.untyped_storage()))
        if len(kept) == 1:  # forward only: gelu's backward has run, the first matmul's is next
            h.register_hook(lambda grad: dead.append(kept[0].expired()))
        return torch.nn.functional.gelu(h) @ w2

    x = randn(64, 32, requires_grad=True)
    expected = torch.autograd.grad(block(x).sum(), (x, w1, w2))
    assert dead == [True]
    kept.clear()
    dead.clear()
    out = remat.remat(block, policy=policies.save_matmuls, strategy=strategy)(x)  # type: ignore[call-overload]
    before = recomputes()
    got = torch.autograd.grad(out.sum(), (x, w1, w2))
    assert recomputes() == before + 1
    assert dead == [True]
    torch.testing.assert_close(got, expected)


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["rerun", "replay"])
@pytest.mark.parametrize("retain", [False, True])
def test_a_kept_output_gone_before_recompute_runs_its_op_again(retain: bool, strategy: str) -> None:
    # sin's backward runs first (created last) and releases the kept h; tanh's then asks for a recompute that needs
    # h, whose kept output is gone: the matmul runs again. With `retain_graph` nothing is released, and a second
    # backward hands h back again.
    w = randn(32, 32, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = x @ w
        e = (h * 3).tanh()
        return h.sin() + e

    x = randn(16, 32, requires_grad=True)
    expected = torch.autograd.grad(block(x).sum(), (x, w))
    out = remat.remat(block, policy=policies.save_matmuls, strategy=strategy)(x)  # type: ignore[call-overload]
    before = recomputes()
    matmuls = CountOps(lambda func: func is torch.ops.aten.mm.default)
    with matmuls:
        got = torch.autograd.grad(out.sum(), (x, w), retain_graph=retain)
    assert recomputes() == before + 1
    assert matmuls.count == 2 + (not retain)  # backward's two, and the forward's run again where h was gone
    torch.testing.assert_close(got, expected)
    if retain:
        again = torch.autograd.grad(out.sum(), (x, w))
        torch.testing.assert_close(again, expected)
