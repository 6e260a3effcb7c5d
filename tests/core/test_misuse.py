"""Misuse that used to pass silently or show remat's internals: generator and coroutine functions, keywords
that belong to another remat function, and a plan made while the switch is off."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import torch
from torch import nn

import remat


def _generator(x: torch.Tensor) -> Iterator[torch.Tensor]:
    yield x.exp()


async def _coroutine(x: torch.Tensor) -> torch.Tensor:
    return x.exp()


async def _async_generator(x: torch.Tensor) -> AsyncIterator[torch.Tensor]:
    yield x.exp()


@pytest.mark.parametrize(
    ("fn", "kind"),
    [(_generator, "a generator function"), (_coroutine, "a coroutine function"),
     (_async_generator, "an async generator function")],
)
@pytest.mark.parametrize("decorate", [remat.remat, remat.remat(strategy="replay"), remat.region()])
def test_functions_that_return_before_running_are_refused_when_decorated(
    fn: object, kind: str, decorate: object
) -> None:
    with pytest.raises(TypeError) as info:
        decorate(fn)  # type: ignore[operator]
    message = str(info.value)
    assert message.startswith("remat: ") and f"`{fn.__qualname__}` is {kind}" in message  # type: ignore[attr-defined]
    assert "remat.region()" in message, "it says what to do instead"


def test_a_generator_method_and_a_generator_forward_are_refused() -> None:
    with pytest.raises(TypeError, match="generator function"):

        class Block(nn.Module):
            @remat.remat
            def forward(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
                yield x

    class Streamer(nn.Module):
        def forward(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
            yield x

    with pytest.raises(TypeError, match=r"Streamer` is a generator function"):
        remat.remat(Streamer)


def test_budget_on_the_decorator_names_the_site_and_remat_apply() -> None:
    with pytest.raises(TypeError) as info:

        @remat.remat(budget=0.5)  # type: ignore[call-overload, untyped-decorator]
        def block(x: torch.Tensor) -> torch.Tensor:
            return x

    message = str(info.value)
    assert message.startswith("remat: ") and "block` got `budget=`" in message
    assert "remat.apply(model, budget=..., sample=...)" in message
    assert "Options" not in message and "__init__" not in message


def test_unknown_keywords_on_an_instance_leave_it_untouched() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(TypeError) as info:
        remat.remat(layer, every=2, colour="red")  # type: ignore[call-overload]
    message = str(info.value)
    assert "`Linear`" in message and "`every=`" in message and "`colour=`" in message
    assert "remat.apply(model, where, every=...)" in message
    assert not layer._forward_pre_hooks and not layer._forward_hooks
    assert len(remat.plan(layer)) == 0


@pytest.mark.parametrize("call", ["apply", "region", "plan", "undo"])
def test_python_keyword_errors_name_the_public_function(call: str) -> None:
    fn = getattr(remat, call)
    args = () if call == "region" else (nn.Linear(2, 2),)
    with pytest.raises(TypeError) as info:
        fn(*args, colour="red")
    assert str(info.value).startswith(f"remat.{call}()"), str(info.value)


def test_plan_says_when_the_switch_is_off() -> None:
    model = remat.apply(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert "switch is off" not in str(remat.plan(model))
    with remat.enabled(False):
        text = str(remat.plan(model))
    assert "2 rematerialized sites" in text and "The REMAT switch is off" in text
    assert "switch is off" not in str(remat.plan(nn.Linear(2, 2))), "no sites, nothing to say about them"


def _mlp(x: torch.Tensor) -> torch.Tensor:
    return x.relu()


@pytest.mark.parametrize(("target", "said"), [(_mlp, "`function`"), (nn.Linear, "the class `Linear`")])
def test_apply_on_a_function_or_a_class_points_to_the_decorator(target: object, said: str) -> None:
    with pytest.raises(TypeError) as info:
        remat.apply(target, budget=0.5, sample=torch.randn(2, 2))  # type: ignore[type-var]
    message = str(info.value)
    assert message.startswith("remat: apply expects an nn.Module") and said in message
    assert "`@remat`" in message, "it says what to do instead"
    with pytest.raises(TypeError, match="`@remat`"):
        remat.apply(target)  # type: ignore[type-var]


@pytest.mark.parametrize("site", ["decorator", "region", "apply"])
def test_a_policy_given_by_name_is_refused_naming_the_policy(site: str) -> None:
    """`policy="save_matmuls"` names the object to pass (NOTE [ A policy is an object, not its name ]), at every
    entry point that takes a policy, when the site is made."""
    with pytest.raises(TypeError, match=r"not its name: got the string 'save_matmuls'; pass "
                                        r"remat\.policies\.save_matmuls itself"):
        if site == "decorator":
            remat.remat(policy="save_matmuls")(lambda x: x)  # type: ignore[arg-type]
        elif site == "region":
            remat.region(policy="save_matmuls")  # type: ignore[arg-type]
        else:
            remat.apply(nn.Sequential(nn.Linear(2, 2)), nn.Linear, policy="save_matmuls")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"the ready ones are remat\.policies\.save_nothing, .*save_tagged"):
        remat.remat(policy="matmuls")(lambda x: x)  # type: ignore[arg-type]


def test_a_fraction_above_one_says_what_it_is_a_fraction_of() -> None:
    with pytest.raises(ValueError, match=r"a float `budget` is a fraction in \(0, 1\], but got 1\.5; .*no remat's "
                                         r"step peak, the most bytes live during a step above its start"):
        remat.apply(nn.Sequential(nn.Linear(2, 2)), budget=1.5, sample=torch.randn(1, 2))
