"""Drop-ins for torch.utils.checkpoint (docs/guides/migrating.md): torch's signatures and keywords, gradients equal
the baseline, and keywords that cannot be honoured raise clear errors."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import CountOps, assert_same_grads, randn
from models import MLP, ConvBN, TransformerBlock
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat
from remat._engine import stats as _stats


def checkpointed(**keywords: Any) -> Callable[[Any], Callable[..., Any]]:
    """A variant for `assert_same_grads`: call the target through `remat.checkpoint` with `keywords`."""
    return lambda target: lambda *args, **kwargs: remat.checkpoint(target, *args, **keywords, **kwargs)


@pytest.mark.parametrize("use_reentrant", [True, False, None])
@pytest.mark.parametrize(
    ("make", "shape"),
    [(MLP, (4, 8)), (TransformerBlock, (2, 5, 8)), (ConvBN, (2, 3, 5, 5))],
    ids=["mlp", "transformer", "conv-bn"],
)
def test_use_reentrant_any_value_matches_baseline(
    use_reentrant: bool | None, make: type[nn.Module], shape: tuple[int, ...]
) -> None:
    before = _stats.recomputes
    assert_same_grads(make, (randn(*shape, requires_grad=True),), checkpointed(use_reentrant=use_reentrant))
    assert _stats.recomputes == before + 1


def test_keyword_arguments_reach_the_function() -> None:
    def fn(x: torch.Tensor, *, mask: torch.Tensor, scale: float) -> torch.Tensor:
        return (x.exp() * mask).sin() * scale

    kwargs = {"mask": randn(4, requires_grad=True, seed=1), "scale": 3.0}
    assert_same_grads(lambda: fn, (randn(4, requires_grad=True),), checkpointed(use_reentrant=False), kwargs=kwargs)


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_preserve_rng_state(preserve_rng_state: bool) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x.sin(), 0.5).exp()

    x = randn(64, requires_grad=True)
    torch.manual_seed(0)
    remat.checkpoint(fn, x, preserve_rng_state=preserve_rng_state, use_reentrant=False).sum().backward()
    ours, x.grad = x.grad, None
    torch.manual_seed(0)
    fn(x).sum().backward()
    assert torch.allclose(ours, x.grad) is preserve_rng_state  # without it, recompute draws a new mask
    if preserve_rng_state:
        assert_same_grads(lambda: fn, (x,), checkpointed(preserve_rng_state=True))


def test_context_fn_with_two_null_contexts() -> None:
    entered: list[str] = []

    class Recording(nullcontext[None]):
        def __init__(self, label: str) -> None:
            super().__init__()
            self.label = label

        def __enter__(self) -> None:
            entered.append(self.label)

    def contexts() -> tuple[Recording, Recording]:
        return Recording("forward"), Recording("recompute")

    assert_same_grads(MLP, (randn(4, 8, requires_grad=True),), checkpointed(context_fn=contexts, use_reentrant=False))
    assert entered == ["forward", "recompute"]


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A torch selective-checkpoint policy: matmuls kept, the rest recomputed."""
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE_MATMULS = partial(create_selective_checkpoint_contexts, _save_matmuls)


def _matmul_sin_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).sin() @ w


def _two_matrices() -> tuple[torch.Tensor, torch.Tensor]:
    return randn(4, 4, requires_grad=True), randn(4, 4, requires_grad=True, seed=1)


def test_context_fn_with_torch_selective_checkpoint_contexts() -> None:
    fn, inputs, selective = _matmul_sin_matmul, _two_matrices(), _SELECTIVE_MATMULS
    assert_same_grads(lambda: fn, inputs, checkpointed(context_fn=selective, use_reentrant=False))

    counts = []
    for context_fn in (selective, None):
        x, w = (t.detach().clone().requires_grad_() for t in inputs)
        y = remat.checkpoint(fn, x, w, context_fn=context_fn, use_reentrant=False)
        with CountOps(lambda func: func is torch.ops.aten.mm.default) as counter:
            y.sum().backward()
        counts.append(counter.count)
    assert counts[0] < counts[1], "the saved matmul must not run again in recompute"


def test_torch_selective_policy_is_asked_once_per_call_in_forward_only() -> None:
    """NOTE [ Selective contexts ] in remat/_sites/checkpoint.py: remat carries out torch's policy function, called as
    torch calls it (in forward, with the op's output), and recompute reuses forward's decisions; torch's own modes
    are never entered, so no torch release warns about saved-tensor hooks around them."""
    asked: list[tuple[Any, bool, bool]] = []

    def every_other_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        asked.append((op, ctx.is_recompute, getattr(ctx, "op_output", None) is not None))
        if op is not torch.ops.aten.mm.default:
            return CheckpointPolicy.PREFER_RECOMPUTE
        mms = sum(1 for seen, _, _ in asked if seen is torch.ops.aten.mm.default)
        return CheckpointPolicy.MUST_SAVE if mms % 2 else CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return ((x @ w).sin() @ w).tanh() @ w

    inputs = (randn(4, 4, requires_grad=True), randn(4, 4, requires_grad=True, seed=1))
    selective = partial(create_selective_checkpoint_contexts, every_other_mm)
    y = remat.checkpoint(fn, *inputs, context_fn=selective, use_reentrant=False)
    in_forward = len(asked)
    assert in_forward > 0 and not any(recompute for _, recompute, _ in asked)
    with CountOps(lambda func: func is torch.ops.aten.mm.default) as counter:
        y.sum().backward()
    assert len(asked) == in_forward, "the policy was asked again in recompute"
    assert counter.count == 1 + 6, "recompute ran the one matmul the policy did not keep (and backward its six)"
    asked.clear()
    assert_same_grads(lambda: fn, inputs, checkpointed(context_fn=selective, use_reentrant=False))


@pytest.mark.parametrize("determinism_check", ["default", "none"])
def test_determinism_check_values(determinism_check: str) -> None:
    state = {"wide": False}

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.exp()
        return (torch.cat([h, h]) if state["wide"] else h).sin().sum() * x

    assert_same_grads(lambda: fn, (randn(4, requires_grad=True),), checkpointed(determinism_check=determinism_check))
    y = remat.checkpoint(fn, randn(4, requires_grad=True), determinism_check=determinism_check)
    state["wide"] = True
    if determinism_check == "default":
        with pytest.raises(remat.RecomputeMismatchError, match="fn"):
            y.sum().backward()
    else:
        with pytest.raises(RuntimeError) as info:  # autograd itself trips over the wrong shape later on
            y.sum().backward()
        assert not isinstance(info.value, remat.RecomputeMismatchError)


@pytest.mark.parametrize(("early_stop", "runs"), [(True, 2), (False, 3)])
def test_early_stop_and_debug_are_accepted(early_stop: bool, runs: int) -> None:
    tails: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.sin().exp()
        tails.append(1)  # after the last needed tensor
        h.exp()  # saved in forward but not needed (see NOTE [ Early stop ])
        return h * 2.0

    assert_same_grads(
        lambda: fn, (randn(4, requires_grad=True),), checkpointed(early_stop=early_stop, debug=True)
    )
    assert len(tails) == runs  # baseline, forward, and recompute only without early stop


@pytest.mark.parametrize(
    ("keywords", "error", "words"),
    [
        ({"determinism_check": "strict"}, ValueError, "determinism_check"),
        ({"use_reentrant": "yes"}, TypeError, "use_reentrant"),
        ({"preserve_rng_state": 1}, TypeError, "preserve_rng_state"),
        ({"debug": "on"}, TypeError, "debug"),
        ({"early_stop": None}, TypeError, "early_stop"),
    ],
)
def test_bad_keywords_raise(keywords: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        remat.checkpoint(torch.sin, randn(3, requires_grad=True), **keywords)


def test_not_callable_raises_type_error() -> None:
    with pytest.raises(TypeError, match="callable"):
        remat.checkpoint(3, randn(3))  # type: ignore[arg-type]


def test_checkpoint_under_no_grad_is_a_plain_call() -> None:
    with torch.no_grad():
        y = remat.checkpoint(lambda t: t.sin().exp(), randn(3, requires_grad=True), use_reentrant=False)
    assert not y.requires_grad


# -- checkpoint_sequential --------------------------------------------------------------------------------
def _sequence() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.BatchNorm1d(6), nn.GELU(), nn.Linear(6, 6), nn.Sigmoid()
    )


@pytest.mark.parametrize("segments", [1, 2, 3, 7])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_sequential_matches_baseline(segments: int, use_reentrant: bool) -> None:
    assert_same_grads(
        _sequence, (randn(5, 6, requires_grad=True),),
        lambda seq: lambda x: remat.checkpoint_sequential(seq, segments, x, use_reentrant=use_reentrant),
        expect_recompute=segments > 1,  # as in torch, the last segment runs without checkpointing
    )


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Softplus()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_checkpoint_sequential_on_a_list_of_callables_with_keywords() -> None:
    _, ours = assert_same_grads(
        Chain, (randn(5, 6, requires_grad=True),),
        lambda chain: lambda x: remat.checkpoint_sequential(
            list(chain.layers), 2, x, use_reentrant=False, preserve_rng_state=False, determinism_check="none"
        ),
    )
    assert ours.grads["parameter layers.0.weight"] is not None


def test_checkpoint_sequential_rematerializes_all_but_the_last_segment() -> None:
    before = _stats.recomputes
    seq = _sequence().double()
    remat.checkpoint_sequential(seq, 3, randn(5, 6, requires_grad=True), use_reentrant=False).sum().backward()
    assert _stats.recomputes - before == 2


@pytest.mark.parametrize("segments", [0, -1, 1.5, True])
def test_checkpoint_sequential_bad_segments(segments: Any) -> None:
    with pytest.raises(ValueError, match="segments"):
        remat.checkpoint_sequential(_sequence(), segments, randn(5, 6))


# -- torch's global switches (docs/guides/migrating.md) -------------------------------------------------------
def test_torch_set_checkpoint_early_stop_applies() -> None:
    tails: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.sin().exp()
        tails.append(1)
        h.exp()  # saved in forward, not needed: early stop skips the rest of the function
        return h * 2.0

    x = randn(4, requires_grad=True)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        remat.checkpoint(fn, x, use_reentrant=False).sum().backward()
    assert len(tails) == 2, "set_checkpoint_early_stop(False) must make recompute run to the end"
    tails.clear()
    remat.checkpoint(fn, x, use_reentrant=False, early_stop=False).sum().backward()
    assert len(tails) == 2
    tails.clear()
    with torch.utils.checkpoint.set_checkpoint_early_stop(True):
        remat.checkpoint(fn, x, use_reentrant=False, early_stop=False).sum().backward()
    assert len(tails) == 1, "the global switch wins over the keyword, as in torch"


def test_torch_set_checkpoint_debug_enabled_applies() -> None:
    calls: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        h = x.exp()
        return (h.sin() if len(calls) == 1 else h).cos()

    with torch.utils.checkpoint.set_checkpoint_debug_enabled(True):
        y = remat.checkpoint(fn, randn(4, requires_grad=True), use_reentrant=False)
        with pytest.raises(remat.RecomputeMismatchError, match=r"(?s)Op traces.*>> "):
            y.sum().backward()


def test_a_count_mismatch_uses_torchs_words_too() -> None:
    calls: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        h = x.exp()
        return (h.sin() if len(calls) == 1 else h).cos()  # recompute saves one tensor fewer

    y = remat.checkpoint(fn, randn(4, requires_grad=True), use_reentrant=False, early_stop=False)
    with pytest.raises(remat.RecomputeMismatchError) as info:
        y.sum().backward()
    assert "A different number of tensors was saved during the original forward and recomputation" in str(
        info.value
    )
    assert "`test_a_count_mismatch_uses_torchs_words_too.<locals>.fn`" in str(info.value)


def test_graph_exec_group_shares_one_recompute() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sin().exp(), x.cos().exp()

    expected = [torch.autograd.grad(out.sum(), x)[0] for x in [randn(5, requires_grad=True)] for out in fn(x)]
    for group, recomputes in ((True, 1), (False, 2)):
        x = randn(5, requires_grad=True)
        a, b = remat.checkpoint(fn, x, use_reentrant=False)
        before = _stats.recomputes
        with torch.utils.checkpoint.GraphExecGroup() if group else nullcontext():
            grads = [torch.autograd.grad(a.sum(), x)[0], torch.autograd.grad(b.sum(), x)[0]]
        assert _stats.recomputes - before == recomputes, group
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want)


def test_decorator_form_of_torch_2_14() -> None:
    """`checkpoint(use_reentrant=False)(fn)`, torch 2.14's decorator form: every call is checkpointed."""

    def fn(x: torch.Tensor, *, scale: float) -> torch.Tensor:
        return (x.exp() * scale).sin()

    decorated = remat.checkpoint(use_reentrant=False, preserve_rng_state=False)(fn)
    assert decorated.__name__ == "fn"
    assert_same_grads(lambda: fn, (randn(4, requires_grad=True),),
                      lambda target: remat.checkpoint(use_reentrant=False)(target), kwargs={"scale": 2.0})
    with pytest.raises(ValueError, match="`scale`"):
        remat.checkpoint(use_reentrant=False, scale=2.0)
    with pytest.raises(ValueError, match="determinism_check"):
        remat.checkpoint(determinism_check="values")  # checked when decorating, not at the first call


@pytest.mark.parametrize("respect", [None, False])
def test_respect_saved_tensors_hooks_none_and_false_are_remat_s_behaviour(respect: bool | None) -> None:
    """torch 2.14's keyword: what a selective policy keeps stays with remat, and nothing warns (the suite's
    filterwarnings turns a warning into an error), around saved-tensor hooks of the user's too."""
    fn, inputs, selective = _matmul_sin_matmul, _two_matrices(), _SELECTIVE_MATMULS

    def variant(target: Any) -> Any:
        def call(*args: Any) -> Any:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                return remat.checkpoint(target, *args, context_fn=selective, use_reentrant=False,
                                        respect_saved_tensors_hooks=respect)

        return call

    assert_same_grads(lambda: fn, inputs, variant)


def test_respect_saved_tensors_hooks_true_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="respect_saved_tensors_hooks=True"):
        remat.checkpoint(torch.sin, randn(2, requires_grad=True), respect_saved_tensors_hooks=True)
    with pytest.raises(TypeError, match="respect_saved_tensors_hooks"):
        remat.checkpoint(torch.sin, randn(2, requires_grad=True), respect_saved_tensors_hooks="yes")
