"""A kept output that the function changes in place after it was kept (NOTE [ A kept output changed in place ] in
remat/_engine/kept.py; docs/guides/policies.md, "A kept output changed in place").

A policy keeps the op's output tensor itself. Before the fix, a function that changed it afterwards (`h = x @ w;
h.mul_(2)`, `h += 1`, `s.masked_fill_(...)`) got it back in recompute with the change applied, and the change was
applied a second time: wrong gradients and no error (issue 51's table: 0.4 to 2.5 off in float64). Here every row of
that table runs at every way a tensor is kept, in float64, against the same function without remat, on the CPU and on
the device written in Python (tests/pydevice.py); each test also proves that recompute ran, and where it matters that
the changed op, and only it, ran again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import CountOps, assert_same_grads, assert_same_on_device, randn, recomputes
from seeded import keeps_noisy, noisy_scale
from test_random_kept import Noisy
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat
from remat import policies
from remat._core.policies import Policy, matmuls
from remat._measure.track import track

MM = torch.ops.aten.mm.default


# -- the rows of the table -------------------------------------------------------------------------------


def scaled(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = x @ w1
    h.mul_(2)
    return (h.sin() @ w2).cos()


def shifted(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = x @ w1
    h += 1.0
    return h.tanh() @ w2


def masked(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    s = x @ w1
    s.masked_fill_(s > 1, -1.0)
    return s.softmax(-1) @ w2


def through_a_view(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = x @ w1
    h[:, :4].mul_(3)  # the kept tensor itself is never named: its version counts changes through views
    return h.sin() @ w2


def batched(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = x.view(2, 4, 16) @ w1  # mm, then an `_unsafe_view`: a version counter of its own (rule 7 of the NOTE)
    h.mul_(2)
    return (h.sin() @ w2).cos()


def scaled_scores(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    q = (x @ w1).view(2, 2, 2, 16)
    s = q @ q.transpose(-1, -2)  # attention's scores: bmm, then an `_unsafe_view`
    s /= 4.0  # as transformers' Falcon scales them
    return (s.softmax(-1) @ q).reshape(8, 16) @ w2


ROWS = {"mul_": scaled, "+=": shifted, "masked_fill_": masked, "through a view": through_a_view,
        "through an _unsafe_view": batched, "scores scaled in place": scaled_scores}


def inputs(device: str = "cpu") -> tuple[torch.Tensor, ...]:
    return tuple(
        (randn(*shape, seed=seed) * scale).to(device).requires_grad_()
        for shape, seed, scale in (((8, 16), 0, 1.0), ((16, 16), 1, 0.5), ((16, 16), 2, 0.5))
    )


# -- every way a tensor is kept ------------------------------------------------------------------------------------


def _keep_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op is MM else CheckpointPolicy.PREFER_RECOMPUTE


def _decorated(**options: Any) -> Callable[[Any], Any]:
    return lambda fn: remat.remat(fn, **options)


def _region(**options: Any) -> Callable[[Any], Any]:
    def variant(fn: Any) -> Any:
        def call(*args: torch.Tensor) -> torch.Tensor:
            with remat.region(**options):
                return fn(*args)  # type: ignore[no-any-return]

        return call

    return variant


def _checkpoint(**flags: Any) -> Callable[[Any], Any]:
    """remat's drop-in with torch's own selective contexts keeping every mm (NOTE [ Selective contexts ])."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, _keep_mm, **flags)
    return lambda fn: functools.partial(remat.checkpoint, fn, use_reentrant=False, context_fn=context_fn)


def _host() -> remat.Offload:
    return remat.offload(include_cpu=True, min_bytes=0)  # on the CPU too, through the host copies' own path


SAVE_MATMULS = policies.save_matmuls
KEEPING: dict[str, Callable[[Any], Any]] = {
    "save_matmuls rerun": _decorated(policy=SAVE_MATMULS),
    "save_matmuls replay": _decorated(policy=SAVE_MATMULS, strategy="replay"),
    "save_matmuls region": _region(policy=SAVE_MATMULS),
    "callable rerun": _decorated(policy=matmuls),
    "callable replay": _decorated(policy=matmuls, strategy="replay"),
    "union rerun": _decorated(policy=SAVE_MATMULS | policies.save_tagged("other")),
    "union region": _region(policy=SAVE_MATMULS | policies.save_tagged("other")),
    "some calls (a budget's part)": _decorated(policy=Policy(ops=(matmuls,), calls=frozenset({0, 1}))),
    "offloaded policy rerun": _decorated(policy=policies.offload(SAVE_MATMULS), offload=_host()),
    "offloaded policy, kept on the CPU": _decorated(policy=policies.offload(SAVE_MATMULS)),  # the pass-through
    "offloaded policy replay": _decorated(policy=policies.offload(SAVE_MATMULS), strategy="replay", offload=_host()),
    "offload=True region": _region(policy=SAVE_MATMULS, offload=_host()),
    "checkpoint, torch's selective contexts": _checkpoint(),
    "checkpoint, allow_cache_entry_mutation=True": _checkpoint(allow_cache_entry_mutation=True),
}


@pytest.mark.parametrize("keeping", list(KEEPING))
@pytest.mark.parametrize("row", list(ROWS))
def test_a_kept_output_changed_in_place_gives_the_gradients_of_no_remat(row: str, keeping: str) -> None:
    assert_same_grads(lambda: ROWS[row], inputs(), KEEPING[keeping])


def _backward_matmuls(fn: Any, variant: Callable[[Any], Any] | None) -> int:
    out = (fn if variant is None else variant(fn))(*inputs())
    with CountOps(lambda func: func is MM) as counter:
        out.sum().backward()
    return counter.count


def scaled_out_of_place(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = (x @ w1) * 2
    return (h.sin() @ w2).cos()


@pytest.mark.equivalence
@pytest.mark.parametrize("keeping", ["save_matmuls rerun", "save_matmuls replay", "save_matmuls region",
                                     "offloaded policy rerun", "checkpoint, torch's selective contexts"])
def test_only_the_changed_op_runs_again(keeping: str) -> None:
    """Recompute runs the matmul whose output was changed, and hands back the one that was not: one matmul more in
    backward than no remat's, none more where the change is out of place."""
    plain = _backward_matmuls(scaled, None)
    before = recomputes()
    assert _backward_matmuls(scaled, KEEPING[keeping]) == plain + 1
    assert recomputes() > before
    assert _backward_matmuls(scaled_out_of_place, KEEPING[keeping]) == plain


def saved_after_the_change(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = x @ w1
    h.mul_(2)
    return h.sin() @ w2  # sin saves the changed h: in the memory of the kept output


@pytest.mark.parametrize("keeping", ["save_matmuls rerun", "save_matmuls replay", "save_matmuls region"])
def test_a_changed_kept_output_holds_what_full_remat_holds(keeping: str) -> None:
    """Rule 3 of the NOTE: a changed kept output is dropped when forward ends, and a tensor autograd saves in its
    memory is rebuilt, not kept by reference: the site holds what full remat holds."""

    def held(variant: Callable[[Any], Any]) -> int:
        args = inputs()
        with track() as tracker:
            out = variant(saved_after_the_change)(*args)
            after_forward = tracker.current_bytes
        out.sum().backward()
        return after_forward

    full = held(_decorated() if keeping != "save_matmuls region" else _region())
    assert held(KEEPING[keeping]) == full
    assert_same_grads(lambda: saved_after_the_change, inputs(), KEEPING[keeping])


# -- remat.tag on a tensor then changed in place (the table's last row) -------------------------------------------


def tagged(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = remat.tag((x @ w1).sin(), "h")
    h.mul_(3)
    return h.cos() @ w2


def tagged_then_saved(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = remat.tag((x @ w1).sin(), "h")
    h.mul_(3)
    return h.exp() @ w2  # exp saves its output, cos would save the changed h


TAGS = {
    "rerun": _decorated(policy=policies.save_tagged("h")),
    "replay": _decorated(policy=policies.save_tagged("h"), strategy="replay"),
    "region": _region(policy=policies.save_tagged("h")),
    "offloaded rerun": _decorated(policy=policies.offload(policies.save_tagged("h")), offload=_host()),
    "union rerun": _decorated(policy=SAVE_MATMULS | policies.save_tagged("h")),
}


@pytest.mark.parametrize("fn", [tagged, tagged_then_saved], ids=["tagged", "tagged then saved"])
@pytest.mark.parametrize("keeping", list(TAGS))
def test_a_tagged_tensor_changed_in_place_gives_the_gradients_of_no_remat(keeping: str, fn: Any) -> None:
    """What is kept is the value at the tag, or recompute rebuilds it: never the changed tensor (before the fix,
    rerun raised "a leaf Variable that requires grad is being used in an in-place operation", naming no site)."""
    assert_same_grads(lambda: fn, inputs(), TAGS[keeping])


# -- random ops: NOTE [ Random ops ] in remat/_engine/rng.py --------------------------------------------------------


class NoisyChanged(Noisy):
    """A matmul, the random op a policy keeps (one op drawing its mask, as fused attention with dropout on CUDA),
    its output changed in place, then an ordinary dropout recomputed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = noisy_scale(self.fc1(x), 0.3)
        h.mul_(2)
        h = F.dropout(torch.tanh(h), 0.5, self.training)
        return self.fc2(h)  # type: ignore[no-any-return]


RANDOM = policies.save_matmuls | keeps_noisy


@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_a_kept_random_op_changed_in_place_runs_again_drawing_what_it_drew(strategy: str) -> None:
    assert_same_grads(NoisyChanged, (randn(4, 8, requires_grad=True),),
                      lambda m: remat.remat(m, policy=RANDOM, strategy=strategy))


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_without_preserve_rng_a_changed_random_op_is_a_clear_error(strategy: str) -> None:
    """Running it again would draw another mask: an error naming the site, the op and the change."""
    module = remat.remat(NoisyChanged().double(), policy=RANDOM, strategy=strategy, preserve_rng=False,
                         name="noisy block")
    out = module(randn(4, 8, requires_grad=True))
    with pytest.raises(remat.RematError, match=r"`noisy block` keeps the output of remat_tests.noisy_scale.default, "
                                               r"which draws random numbers.*version went from \d+ to \d+"):
        out.sum().backward()


@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_an_op_that_writes_its_argument_is_never_kept(strategy: str) -> None:
    """`bernoulli_` with its own generator, chosen by a callable policy: recompute must write into the tensor it
    rebuilt (before the fix rerun handed back forward's and left the rebuilt one unwritten), drawing what it drew,
    and the generator is put back after recompute. Without `preserve_rng` it is not kept either: it runs again, as
    every random op a site does not keep."""
    generator = torch.Generator()

    def fn(x: torch.Tensor) -> torch.Tensor:
        mask = torch.empty_like(x).bernoulli_(0.5, generator=generator)
        return (x * mask).tanh() * 2

    def make() -> Any:
        generator.manual_seed(7)
        return fn

    def keeps_bernoulli(op: Any) -> bool:
        return op is torch.ops.aten.bernoulli_.float

    keeps = _decorated(policy=keeps_bernoulli, strategy=strategy)
    x = randn(64, requires_grad=True)
    assert_same_grads(make, (x,), keeps)
    out = keeps(make())(x.detach().requires_grad_())
    after_forward = generator.get_state()
    out.sum().backward()
    assert torch.equal(generator.get_state(), after_forward)
    remat.remat(make(), policy=keeps_bernoulli, strategy=strategy, preserve_rng=False)(x).sum().backward()


# -- the device written in Python ---------------------------------------------------------------------------------

D0 = "remat_test:0"
D1 = "remat_test:1"


@pytest.mark.usefixtures("test_device")
@pytest.mark.parametrize("keeping", ["save_matmuls rerun", "save_matmuls replay", "save_matmuls region",
                                     "offloaded policy rerun", "checkpoint, torch's selective contexts"])
@pytest.mark.parametrize("row", list(ROWS))
def test_on_the_device_written_in_python(row: str, keeping: str) -> None:
    assert_same_on_device(lambda: ROWS[row], inputs(D0), KEEPING[keeping])


@pytest.mark.usefixtures("test_device")
@pytest.mark.parametrize("strategy", ["rerun", "replay"])
def test_a_changed_random_op_on_a_device_with_a_generator_per_index(strategy: str) -> None:
    base, _ = assert_same_on_device(lambda: NoisyChanged().double().to(D1), (randn(4, 8, requires_grad=True).to(D1),),
                                    lambda m: remat.remat(m, policy=RANDOM, strategy=strategy))
    assert base.drew[2], "nothing was drawn on index 1: the test would not see its stream"
