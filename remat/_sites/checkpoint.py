"""Drop-ins for `torch.utils.checkpoint.checkpoint` and `checkpoint_sequential`.

Replacing the import is the whole migration: every keyword torch takes is accepted and honoured.
`use_reentrant` is accepted with either value and both run remat's saved-tensor-hook engine: it gives the
gradients reentrant checkpoint gives where that one is right, and also where it is not (parameter gradients
when no input requires grad, `torch.autograd.grad`, detached tensors). BatchNorm statistics are updated once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, ParamSpec, TypeVar, overload

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch import nn

from .._core import switch as _switch
from .._core.policies import Policy
from .._core.public import claim
from .._core.torch_compat import selective_policy
from .._engine import rerun as _rerun
from .._engine.compiled import compiling, rerunning_contexts, torch_checkpoint

__all__ = ["checkpoint", "checkpoint_sequential"]

_CHECKS = {"default": True, "none": False}
_P = ParamSpec("_P")
_T = TypeVar("_T")

# NOTE [ Selective contexts ]
# 1. torch's selective-checkpoint contexts given as `context_fn` (the pair `create_selective_checkpoint_contexts`
#    makes) are not entered: remat reads their `policy_fn` and keeps, call by call, the outputs it keeps, through its
#    own policy machinery (`Policy.chooses`, NOTE [ Some calls ] in remat/_core/policies.py). `policy_fn` is called
#    once per op call in forward, with torch's context, as torch calls it; recompute reuses forward's decisions.
# 2. So what the user's policy keeps stays kept and never reaches remat's pack hook as an activation to rebuild,
#    whatever a torch release does with saved-tensor hooks around its own selective modes (2.14 warns that it will
#    route the tensors they keep through them), and a kept op that draws random numbers is handled as any kept
#    random op (NOTE [ Random ops ] in remat/_engine/rng.py), where torch's own modes skip it and shift the stream.
# 3. Any other `context_fn` is entered as given, around forward and around recompute. Under torch.compile the
#    contexts go to torch's checkpoint operator (NOTE [ Under torch.compile ]), torch's selective ones with their
#    recompute mode made to run again an op whose kept output was changed in place (rule 4 there).
# 4. What the user's policy keeps and the function then changes in place is never handed back: the op runs again
#    (NOTE [ A kept output changed in place ] in remat/_engine/kept.py), whatever `allow_cache_entry_mutation`
#    says, where torch raises "has been mutated" (or, with that flag, hands back the changed tensor).


def _function_site(function: Any) -> str:
    return getattr(function, "__qualname__", None) or type(function).__qualname__


def _is_noop(context_fn: Any) -> bool:
    return context_fn is None or getattr(context_fn, "__name__", "") == "noop_context_fn"


_Contexts = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]

_HOOKS_TRUE = (
    "remat: `respect_saved_tensors_hooks=True` routes what a selective policy keeps through the saved-tensor hooks "
    "around the call (torch 2.14); remat keeps it itself and cannot honour that. Pass False or None (the same "
    "here), and keep what the policy keeps in host memory with `remat.policies.offload(...)` on a remat site, or "
    "put the whole call inside `remat.offload()`."
)


@overload
def checkpoint(
    function: Callable[..., _T],
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: _Contexts | None = None,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs: Any,
) -> _T: ...


@overload
def checkpoint(
    function: None = None,
    *,
    use_reentrant: bool | None = None,
    context_fn: _Contexts | None = None,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]: ...


def checkpoint(
    function: Callable[..., Any] | None = None,
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: _Contexts | None = None,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Call `function(*args, **kwargs)` with its activations rematerialized, like torch's `checkpoint`.

    Without `function` (torch 2.14's decorator form), returns a decorator that checkpoints every call of the
    function it is given with these keywords: `remat.checkpoint(use_reentrant=False)(fn)`.

    Args:
        function: what to run; keyword arguments are passed through to it.
        use_reentrant: accepted for compatibility; both values use remat's hook-based engine.
        context_fn: returns two context managers, entered around forward and around recompute. torch's
            selective-checkpoint contexts (`create_selective_checkpoint_contexts(policy_fn)`) are carried out
            by remat itself: what `policy_fn` keeps is kept, and a kept op that draws random numbers leaves the
            random stream of recompute as forward left it (NOTE [ Selective contexts ]).
        determinism_check: `"default"` compares shape, dtype and device of what recompute saves with
            forward and raises `remat.RecomputeMismatchError`; `"none"` skips that.
        debug: on a mismatch, show the op traces of forward and recompute side by side.
        early_stop: stop recompute as soon as every needed tensor is back.
        preserve_rng_state: recompute sees forward's RNG state on every device it touched.
        respect_saved_tensors_hooks: torch 2.14's switch for routing what a selective policy keeps through the
            saved-tensor hooks around the call. `None` and `False` are what remat does (it keeps those tensors
            itself, and nothing warns); `True` cannot be honoured and raises.

    torch's global switches apply as they do to torch's checkpoint: inside
    `torch.utils.checkpoint.set_checkpoint_early_stop(flag)` the flag overrides `early_stop`, inside
    `set_checkpoint_debug_enabled(flag)` it overrides `debug`, and under `GraphExecGroup` one recompute serves
    every backward of the group.

    Raises:
        TypeError, ValueError: for a keyword of the wrong kind or value, or `respect_saved_tensors_hooks=True`.

    >>> import torch, remat
    >>> x = torch.randn(3, requires_grad=True)
    >>> remat.checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
    """
    if function is None and not args:
        if kwargs:
            raise ValueError(
                "remat: checkpoint's decorator form takes checkpoint's own keywords only, but got "
                + ", ".join(f"`{name}`" for name in kwargs) + "."
            )
        options: dict[str, Any] = {
            "use_reentrant": use_reentrant, "context_fn": context_fn, "determinism_check": determinism_check,
            "debug": debug, "early_stop": early_stop, "preserve_rng_state": preserve_rng_state,
            "respect_saved_tensors_hooks": respect_saved_tensors_hooks,
        }
        _check_keywords(**options)  # now, not at the first call
        return functools.partial(_checkpoint_decorator, keywords=options)
    _check_keywords(use_reentrant=use_reentrant, context_fn=context_fn, determinism_check=determinism_check,
                    debug=debug, early_stop=early_stop, preserve_rng_state=preserve_rng_state,
                    respect_saved_tensors_hooks=respect_saved_tensors_hooks)
    if not callable(function):
        raise TypeError(f"remat: checkpoint expects a callable, but got `{type(function).__name__}`.")
    if not _switch._state[0] or not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if compiling():  # see NOTE [ Under torch.compile ]
        keywords: dict[str, Any] = {"determinism_check": determinism_check, "debug": debug,
                                    "preserve_rng_state": preserve_rng_state}
        if context_fn is not None and not _is_noop(context_fn):
            keywords["context_fn"] = functools.partial(rerunning_contexts, context_fn)
        return torch_checkpoint(function, args, kwargs, **keywords)
    # torch's global switches win over the keywords, as in torch.utils.checkpoint.
    if _torch_checkpoint._enable_checkpoint_early_stop is not None:
        early_stop = _torch_checkpoint._enable_checkpoint_early_stop
    if _torch_checkpoint._checkpoint_debug_enabled is not None:
        debug = _torch_checkpoint._checkpoint_debug_enabled
    contexts = policy = None
    if not _is_noop(context_fn):
        assert context_fn is not None
        forward_context, recompute_context = context_fn()
        selective = selective_policy(forward_context, recompute_context)  # NOTE [ Selective contexts ]
        if selective is not None:
            policy = Policy(ops=(selective[0],), chooses=selective[1])
        else:
            contexts = (lambda: forward_context, lambda: recompute_context)
    return _rerun.call(
        function,
        args,
        kwargs,
        site=_function_site(function),
        check=_CHECKS[determinism_check],
        preserve_rng=preserve_rng_state,
        early_stop=early_stop,
        debug=debug or _switch.debug(),
        module=function if isinstance(function, nn.Module) else None,
        contexts=contexts,
        policy=policy,
    )


def _check_keywords(
    *, use_reentrant: Any, context_fn: Any, determinism_check: Any, debug: Any, early_stop: Any,
    preserve_rng_state: Any, respect_saved_tensors_hooks: Any,
) -> None:
    """Raise for a keyword of `checkpoint` of the wrong kind or value."""
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise TypeError(f"remat: `use_reentrant` must be a bool or None, but got {use_reentrant!r}.")
    if context_fn is not None and not callable(context_fn):
        raise TypeError(f"remat: `context_fn` must be a callable, but got `{type(context_fn).__name__}`.")
    if determinism_check not in _CHECKS:
        raise ValueError(
            f"remat: `determinism_check` must be one of {tuple(_CHECKS)}, "
            f"but got {determinism_check!r}."
        )
    for flag, value in (("debug", debug), ("early_stop", early_stop),
                        ("preserve_rng_state", preserve_rng_state)):
        if not isinstance(value, bool):
            raise TypeError(f"remat: `{flag}` must be a bool, but got {value!r}.")
    if respect_saved_tensors_hooks is not None and not isinstance(respect_saved_tensors_hooks, bool):
        raise TypeError(
            f"remat: `respect_saved_tensors_hooks` must be a bool or None, but got {respect_saved_tensors_hooks!r}."
        )
    if respect_saved_tensors_hooks:
        raise ValueError(_HOOKS_TRUE)


def _checkpoint_decorator(function: Callable[_P, _T], *, keywords: dict[str, Any]) -> Callable[_P, _T]:
    @functools.wraps(function)
    def checkpointed(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        call: Callable[..., _T] = checkpoint
        return call(function, *args, **keywords, **kwargs)

    return checkpointed


def checkpoint_sequential(
    functions: nn.Sequential | Iterable[Callable[..., Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run `functions` in `segments` pieces, each but the last rematerialized, like torch's.

    Args:
        functions: an `nn.Sequential` or a list of modules / callables run one after another.
        segments: how many pieces; the last one runs normally (its activations are needed first).
        input: the input of the first function.
        use_reentrant, **kwargs: any keyword of `checkpoint`.

    >>> import torch, remat
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    >>> out = remat.checkpoint_sequential(model, 2, torch.randn(2, 4), use_reentrant=False)
    """
    stages: list[Callable[..., Any]] = list(
        functions.children() if isinstance(functions, nn.Sequential) else functions
    )
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments:
        raise ValueError(f"remat: `segments` must be a positive int, but got {segments!r}.")
    size = len(stages) // segments
    end = -1
    if size > 0:
        for start in range(0, size * (segments - 1), size):
            end = start + size - 1
            input = checkpoint(
                _Stages(stages[start : end + 1]), input, use_reentrant=use_reentrant, **kwargs
            )
    return _Stages(stages[end + 1 :])(input)


class _Stages:
    """Run a list of stages one after another."""

    def __init__(self, stages: list[Callable[..., Any]]) -> None:
        self.stages = stages
        self.__qualname__ = "checkpoint_sequential segment"

    def __call__(self, input: Any) -> Any:
        for stage in self.stages:
            input = stage(input)
        return input

claim(__name__)  # its public names carry __module__ = "remat" (remat/_core/public.py)
