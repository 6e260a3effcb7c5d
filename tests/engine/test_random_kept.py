"""A kept op that draws random numbers: recompute draws exactly what forward drew (NOTE [ Random ops ] in
remat/_engine/rng.py).

On CUDA, attention with dropout is one fused op that draws its mask inside; a policy that keeps it (`save_matmuls`)
skips it in recompute, and before the fix every random op after it in the region drew another mask: wrong gradients
and no error. `tests/seeded.py`'s `noisy_scale` has that shape on any device. Every block here runs it (kept by the
policy) and then an ordinary dropout (recomputed), at every site kind, in both strategies, on the CPU and on the
device written in Python (tests/pydevice.py, per-index generators), in float64, against a run without remat:
outputs, gradients and the state of every generator after backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import CountOps, assert_same_grads, assert_same_on_device, randn, recomputes
from seeded import OP, keeps_noisy, noisy_scale
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat
from remat import policies
from remat._core.policies import Policy
from remat._engine import rng as _rng

POLICIES = {"callable": keeps_noisy, "save_matmuls | callable": policies.save_matmuls | keeps_noisy}


class Noisy(nn.Module):
    """A matmul, the random op a policy keeps, then an ordinary dropout that recompute runs again."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = noisy_scale(self.fc1(x), 0.3)
        h = F.dropout(torch.tanh(h), 0.5, self.training)
        return self.fc2(h)  # type: ignore[no-any-return]


class Twice(Noisy):
    """Two calls of the random op: a budget plan's part may keep one call and recompute the other."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = noisy_scale(self.fc1(x), 0.3)
        h = noisy_scale(torch.tanh(h), 0.2)
        h = F.dropout(h.sin(), 0.5, self.training)
        return self.fc2(h)  # type: ignore[no-any-return]


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Noisy(), Noisy(), Noisy())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)  # type: ignore[no-any-return]


def _sac(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    keep = op is OP or op is torch.ops.aten.mm.default or op is torch.ops.aten.addmm.default
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _function(policy: Any, strategy: str) -> Callable[[nn.Module], Any]:
    def variant(module: nn.Module) -> Any:
        return remat.remat(policy=policy, strategy=strategy)(lambda x: module(x))

    return variant


def _method(policy: Any, strategy: str) -> Callable[[nn.Module], Any]:
    def variant(module: nn.Module) -> nn.Module:
        module.__class__ = type("NoisyMethod", (Noisy,), {
            "forward": remat.remat(policy=policy, strategy=strategy)(Noisy.forward)
        })
        return module

    return variant


def _class(policy: Any, strategy: str) -> Callable[[nn.Module], Any]:
    def variant(module: nn.Module) -> nn.Module:
        module.__class__ = remat.remat(policy=policy, strategy=strategy)(type("NoisyClass", (Noisy,), {}))
        return module

    return variant


def _instance(policy: Any, strategy: str) -> Callable[[nn.Module], Any]:
    return lambda module: remat.remat(module, policy=policy, strategy=strategy)


def _apply(policy: Any, strategy: str) -> Callable[[nn.Module], Any]:
    return lambda model: remat.apply(model, Noisy, policy=policy, strategy=strategy)


def _region(policy: Any, strategy: str) -> Callable[[nn.Module], Any]:
    def variant(model: nn.Module) -> Any:
        def call(x: torch.Tensor) -> Any:
            with remat.region(policy=policy):
                return model(x)

        return call

    return variant


def _checkpoint(policy: Any, strategy: str) -> Callable[[nn.Module], Any]:
    """The drop-in with torch's own selective contexts: the policy is torch's `policy_fn` (`_sac`)."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, _sac)
    return lambda module: functools.partial(remat.checkpoint, module, use_reentrant=False, context_fn=context_fn)


def _offloaded(policy: Any, strategy: str) -> Callable[[nn.Module], Any]:
    """What the policy keeps goes to host memory and comes back (on the CPU through `include_cpu`)."""
    return lambda module: remat.remat(
        module, policy=policies.offload(policy), strategy=strategy, offload=remat.offload(include_cpu=True)
    )


# kind -> (make, variant, strategies it runs under)
KINDS: dict[str, tuple[Callable[[], nn.Module], Callable[[Any, str], Any], tuple[str, ...]]] = {
    "function": (Noisy, _function, ("rerun", "replay")),
    "method": (Noisy, _method, ("rerun", "replay")),
    "class": (Noisy, _class, ("rerun", "replay")),
    "instance": (Noisy, _instance, ("rerun", "replay")),
    "apply": (Stack, _apply, ("rerun", "replay")),
    "region": (Stack, _region, ("replay",)),
    "offload policy": (Noisy, _offloaded, ("rerun", "replay")),
}
CASES = [
    pytest.param(kind, strategy, policy, id=f"{kind}-{strategy}-{policy}")
    for kind, (_, _, strategies) in KINDS.items() for strategy in strategies for policy in POLICIES
]


def _variant(kind: str, strategy: str, policy: str) -> Callable[[nn.Module], Any]:
    return KINDS[kind][1](POLICIES[policy], strategy)


@pytest.mark.parametrize(("kind", "strategy", "policy"), CASES)
def test_a_kept_random_op_leaves_the_random_stream_as_forward_did(kind: str, strategy: str, policy: str) -> None:
    assert_same_grads(KINDS[kind][0], (randn(4, 8, requires_grad=True),), _variant(kind, strategy, policy))


def test_the_drop_in_with_torch_selective_contexts_keeps_the_random_op_and_draws_as_forward() -> None:
    """torch's own modes skip the kept op in recompute and shift the stream; the drop-in carries out the policy."""
    assert_same_grads(Noisy, (randn(4, 8, requires_grad=True),), _checkpoint(None, "rerun"))
    module, x = Noisy().double(), randn(4, 8, requires_grad=True)
    out = _checkpoint(None, "rerun")(module)(x)
    with CountOps(lambda func: func is OP) as counter:
        out.sum().backward()
    assert counter.count == 0, "the random op the policy keeps ran again in recompute"


@pytest.mark.parametrize("keep", [{0}, {1}], ids=["first call", "second call"])
def test_a_budget_part_keeping_some_calls_of_a_random_op(keep: set[int]) -> None:
    """NOTE [ Some calls ]: a budget plan's derived part keeps some calls of an op and runs the others again."""
    policy = Policy(ops=(keeps_noisy,), calls=frozenset(keep))
    assert_same_grads(Twice, (randn(4, 8, requires_grad=True),), lambda m: remat.remat(m, policy=policy))


@pytest.mark.ignores_switch  # remat.chain runs its schedule whatever the switch says
def test_a_chain_of_blocks_with_a_random_op() -> None:
    """A chain keeps no op (it recomputes whole stages), so its stream was right before the fix too."""
    chains: list[Any] = []

    def variant(model: nn.Module) -> nn.Module:
        chains.append(remat.chain(list(model.blocks), segments=2))  # type: ignore[arg-type]
        return chains[-1]  # type: ignore[no-any-return]

    assert_same_grads(Stack, (randn(4, 8, requires_grad=True),), variant, expect_recompute=False)
    assert chains[-1].schedule.extra_forwards() > 0, "the chain recomputed nothing"


@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_retain_graph_backward_twice_with_a_kept_random_op(strategy: str) -> None:
    """The second recompute runs the op whose output the first one dropped, from forward's state."""

    def twice(loss: torch.Tensor, leaves: list[torch.Tensor]) -> None:
        loss.backward(retain_graph=True)
        loss.backward()

    assert_same_grads(Noisy, (randn(4, 8, requires_grad=True),),
                      _instance(policies.save_matmuls | keeps_noisy, strategy), backward=twice)


@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_without_preserve_rng_nothing_is_read(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[Any] = []
    monkeypatch.setattr(_rng.Draw, "after", classmethod(lambda cls, *a: read.append(a)))  # type: ignore[arg-type]
    module = remat.remat(Noisy().double(), policy=keeps_noisy, strategy=strategy, preserve_rng=False)
    module(randn(4, 8, requires_grad=True)).sum().backward()
    assert read == []


@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_a_region_that_keeps_nothing_random_reads_no_generator(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is paid where nothing kept draws: dropout recomputed, matmuls and attention without dropout kept."""
    read: list[Any] = []
    real = _rng.Draw.after.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(_rng.Draw, "after", classmethod(lambda cls, *a: read.append(a) or real(cls, *a)))

    class Attention(Noisy):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc1(x).view(4, 2, 8)
            h = F.scaled_dot_product_attention(h, h, h, dropout_p=0.0)  # tagged as random, draws nothing
            return self.fc2(F.dropout(h.reshape(4, 16), 0.5))  # type: ignore[no-any-return]

    before = recomputes()
    module = remat.remat(Attention().double(), policy=policies.save_matmuls, strategy=strategy)
    module(randn(4, 8, requires_grad=True)).sum().backward()
    assert recomputes() > before and read == []


def test_a_kept_random_op_s_generator_is_read_once_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[Any] = []
    real = _rng.Draw.after.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(_rng.Draw, "after", classmethod(lambda cls, *a: read.append(a) or real(cls, *a)))
    module = remat.remat(Twice().double(), policy=keeps_noisy)
    module(randn(4, 8, requires_grad=True)).sum().backward()
    assert len(read) == 2


def test_which_ops_draw() -> None:
    aten = torch.ops.aten
    q = torch.ones(1, 1, 2, 2)
    assert _rng.draws(OP, (q, 0.5), None)
    assert _rng.draws(aten.bernoulli_.float, (q, 0.5), None)
    assert not _rng.draws(aten.mm.default, (q, q), None)
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert not _rng.draws(sdpa, (q, q, q), None)  # the schema's default dropout_p: 0
    assert not _rng.draws(sdpa, (q, q, q, 0.0), None)
    assert _rng.draws(sdpa, (q, q, q, 0.1), None)
    assert _rng.draws(sdpa, (q, q, q), {"dropout_p": 0.1})
    from remat._core.torch_compat import FakeTensorMode

    with FakeTensorMode() as fake:
        assert not _rng.draws(OP, (fake.from_tensor(q), 0.5), None)  # an estimate's step moves no generator


def test_a_generator_outside_the_stash_is_put_back_after_recompute() -> None:
    """An op given its own `generator=`: recompute sets it, then puts back what it had (a fork)."""
    generator = torch.Generator().manual_seed(7)

    def fn(x: torch.Tensor) -> torch.Tensor:
        mask = torch.empty_like(x).bernoulli_(0.5, generator=generator)
        return (x * mask).tanh() * 2

    policy = lambda op: op is torch.ops.aten.bernoulli_.float  # noqa: E731
    x = randn(16, requires_grad=True)
    out = remat.remat(fn, policy=policy)(x)
    after_forward = generator.get_state()
    before = recomputes()
    out.sum().backward()
    assert recomputes() > before
    assert torch.equal(generator.get_state(), after_forward)


# -- on the device written in Python: per-index generators ----------------------------------------------------------

D1 = "remat_test:1"


@pytest.mark.usefixtures("test_device")
@pytest.mark.parametrize(("kind", "strategy", "policy"), [
    c for c in CASES if c.values[0] not in ("offload policy",)
] + [pytest.param("checkpoint", "rerun", "torch", id="checkpoint-torch")])
def test_on_a_device_with_a_generator_per_index(kind: str, strategy: str, policy: str) -> None:
    make = Stack if kind in ("apply", "region") else Noisy
    variant = _checkpoint(None, strategy) if kind == "checkpoint" else _variant(kind, strategy, policy)
    base, _ = assert_same_on_device(lambda: make().double().to(D1), (randn(4, 8, requires_grad=True).to(D1),),
                                    variant)
    assert base.drew[2], "nothing was drawn on index 1: the test would not see its stream"
