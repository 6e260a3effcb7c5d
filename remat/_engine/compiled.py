"""What a site is inside a compiled frame: torch's checkpoint operator (see NOTE [ Under torch.compile ])."""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._core.errors import alive
from .._core.policies import Policy
from .._core.torch_compat import eval_frame_callback, rerun_changed

__all__ = [
    "SiteForward", "compiled_key", "compiling", "context_for", "in_compiled_call", "rerunning_contexts", "route_module",
    "torch_checkpoint", "unroute_module", "warn_once",
]

# NOTE [ Under torch.compile ]
# Saved-tensor hooks and dispatch modes are graph breaks for dynamo, and a compiled graph saves other tensors
# than the eager function that rerun calls again, so remat's engine cannot run inside a compiled frame.
#
# Rules:
# 1. Inside a compiled frame every site becomes `torch.utils.checkpoint.checkpoint(use_reentrant=False)`, which
#    dynamo turns into its activation-checkpoint operator and the compiler's partitioner honours; the site's
#    policy goes with it as a selective-checkpoint context (`context_for`): the ops the policy saves are
#    MUST_SAVE, every other op PREFER_RECOMPUTE.
# 2. The compiler functionalises RNG itself, so a recompute sees forward's random numbers whatever
#    `preserve_rng` says. What has no counterpart there is warned about once per site, at compile time, and
#    recomputed rather than kept: tag names (`save_tagged`), offloading.
# 3. A module instance (`remat(module)`, `remat.apply`, a budget plan's block) is marked by forward hooks, which
#    cannot wrap a call, so under compile the site is reached through the instance's own `forward`; and
#    `remat(module)` changes the instance and nothing else: no class attribute of the user's classes is replaced
#    or added. A class's `forward` is read by other code (transformers checkpoints a layer only while
#    `type(layer).forward` is its own wrapper; accelerate and PEFT wrap it), and every instance shares it.
# 4. What a selective context keeps and the function then changes in place is never handed back (NOTE [ A kept
#    output changed in place ] in kept.py): compiled code functionalises in-place ops, so what it saves is the
#    op's own value; where torch runs its operator eagerly (`backend="eager"`), its recompute mode runs such an op
#    again (`rerun_changed`) instead of raising "has been mutated", its forward mode watching the `_unsafe_view`s of
#    what it caches too.
#
# Implementation notes:
# 1. (rule 3) The instance's `__dict__` gets `forward`: a `SiteForward`, which `nn.Module._call_impl` finds as
#    `self.forward` (in eager code and while dynamo traces) and which, only while dynamo traces, asks the site
#    for the checkpointed call. In eager code it opens the site's region, whose pre-hook has run (NOTE [ Module
#    instances ] in remat/_sites/targets.py), and calls what the instance called before. `undo` puts back what
#    the instance had: nothing, or a forward of its own.
# 2. (rule 3) The site is an attribute of that object, which dynamo guards on, not an entry of the hook table,
#    which it does not (`skip_nnmodule_hook_guards`): where identical blocks share one compiled forward
#    (`block.compile()`), a site found in the hook table made every block run the graph traced last, whatever
#    its own choice.
# 3. (rule 3) The object holds its module weakly (no cycle through the module's `__dict__`: a model is freed when
#    its last reference goes), pickles, deep-copies and `torch.save`s with the module (`__reduce__` names the
#    module, which the copy or the unpickler then binds), and answers `inspect.signature`, `__name__`, `__func__`,
#    `__self__` as the forward it calls (transformers' `generate` and Trainer read `model.forward`'s signature).
#    A shallow copy (`copy.copy`, DataParallel's replicas) shares the original's object, so it runs the original
#    module; when that is gone the call says so.
compiling = torch.compiler.is_compiling

_eval_frame_callback = eval_frame_callback  # None on a torch without dynamo


def in_compiled_call() -> bool:
    """Whether a torch.compile'd call is running on this thread (traced, or run in eager code after a break)."""
    return compiling() or (_eval_frame_callback is not None and _eval_frame_callback() is not None)


_warned: set[str] = set()


def warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    """Warn with `message` once per process for `key` (a site and what it lacks under compile)."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=stacklevel)


def context_for(policy: Policy | None, site: str, offload: bool = False) -> Callable[[], Any] | None:
    """The selective-checkpoint `context_fn` that keeps what `policy` keeps, or None to recompute everything.

    What cannot be kept in compiled code is warned about when the compiler first traces the site (the context is
    made then, outside dynamo), once per site: tag names, offloading. A policy that keeps some calls of its ops
    (a budget plan's parts) counts the calls in forward and in recompute as eager code does.
    """
    lacks = []
    if offload or (policy is not None and policy.offloads):
        lacks.append("offloads what it keeps in eager code; under torch.compile nothing is offloaded (what the "
                     "policy keeps stays on the device)")
    if policy is not None and policy.names:
        lacks.append(f"keeps tensors tagged {sorted(policy.names)}; under torch.compile tags are not seen, so "
                     "they are recomputed (an op policy, a callable `op -> bool` or `save_matmuls`, is kept there)")
    ops = policy is not None and bool(policy.ops)
    if not ops and not lacks:
        return None
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    saves_op = policy.saves_op if policy is not None and ops else None
    message = f"remat: `{site}` " + "; it also ".join(lacks) + "." if lacks else ""

    calls = policy.calls if policy is not None else None  # NOTE [ Some calls ] in remat/_core/policies.py

    def contexts() -> Any:
        if message:
            warn_once(site, message)
        counted = [0, 0]  # the chosen ops' calls so far, in forward and in recompute (the same order)

        def choose(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if saves_op is None or not saves_op(op):
                return recompute
            if calls is None:
                return save
            phase = 1 if ctx.is_recompute else 0
            index, counted[phase] = counted[phase], counted[phase] + 1
            return save if index in calls else recompute

        return rerun_changed(create_selective_checkpoint_contexts(choose))  # type: ignore[no-untyped-call]

    return contexts


def rerunning_contexts(context_fn: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
    """A user's `context_fn` under torch.compile, called: torch's selective contexts among them run again an op whose
    cached output was changed in place (NOTE [ Under torch.compile ], rule 4); any other contexts as they are. Given to
    torch's checkpoint as `functools.partial(rerunning_contexts, context_fn)`, a form dynamo takes."""
    return rerun_changed(context_fn())


# NOTE [ Guarding on the policy ]
# 1. Inside compiled code, two sites whose policies keep different things never share a compiled graph; sites whose
#    policies keep the same things do.
#
# Implementation notes:
# 1. (rule 1) A site's selective context is a closure made by `context_for`, which torch calls only after dynamo has
#    traced the frame: dynamo guards on the closure's code, the same for every policy. Blocks compiled one by one
#    share one compiled forward among identical blocks, so without more a block whose policy differed only in what it
#    keeps (`save_matmuls` against a budget's part) ran the graph traced first, and a budget's compiled peak depended
#    on which block came first (docs/benchmarks.md).
# 2. (rule 1) So every site hands `torch_checkpoint`, which reads it while dynamo traces, a string naming what its
#    context keeps (`compiled_key`, by value), and dynamo guards on that constant: a block with another key retraces.


def compiled_key(policy: Policy) -> str:
    """What a site's selective context keeps, by value (NOTE [ Guarding on the policy ]); `preserve_rng_state`, a
    plain keyword, is guarded by dynamo itself.

    >>> from remat._core.policies import Policy, matmuls
    >>> some = Policy([matmuls], calls=frozenset({0}))
    >>> compiled_key(Policy([matmuls])) == compiled_key(Policy([matmuls])) != compiled_key(some)
    True
    """
    calls = None if policy.calls is None else sorted(policy.calls)
    ops = [id(op) for op in policy.ops]  # module-level choosers (`matmuls`) or the user's own callables
    return f"ops={ops} names={sorted(policy.names)} calls={calls} offloads={policy.offloads}"


def torch_checkpoint(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, key: str | None = None,
    **keywords: Any,
) -> Any:
    """`torch.utils.checkpoint.checkpoint`, non-reentrant: what a site is inside a compiled frame.

    `key`: the site's `compiled_key`, which dynamo, tracing this call, then guards on (NOTE [ Guarding on the
    policy ]). Dynamo looks at a value it reads, and installs its guard, only when the value is used: a test of it
    is a use.
    """
    from torch.utils.checkpoint import checkpoint

    if key is not None and not key:
        raise ValueError("remat: a site's compiled key is empty; this is a bug in remat, please report it.")
    if keywords.get("context_fn", 0) is None:
        del keywords["context_fn"]
    return checkpoint(fn, *args, use_reentrant=False, **keywords, **kwargs)


class SiteForward:
    """A rematerialized module instance's own `forward` (NOTE [ Under torch.compile ]): what the instance called
    before (its class's forward, or a forward of its own), asked of its site while dynamo traces."""

    __slots__ = ("_module", "own", "site")
    _remat_owned = True  # NOTE [ A model set aside ] in remat/_sites/targets.py

    def __init__(self, module: torch.nn.Module, own: Callable[..., Any] | None, site: Any) -> None:
        self._module = weakref.ref(module)
        self.own = own  # the instance's own forward before remat (a library's or the user's), or None: its class's
        # the instance's forward pre-hook: `site.compiled_call(forward, module, args, kwargs)`, `site.at_forward(self,
        # args, kwargs)`, `site.abandon(module)`
        self.site = site

    def module(self) -> torch.nn.Module:
        return alive(self._module, "a rematerialized module's `forward`")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()  # every call of the module: the reference read here, `module()` only to raise
        if module is None:
            module = self.module()
        own = self.own
        if compiling():
            forward = type(module).forward if own is None else functools.partial(_call_own, own)
            return self.site.compiled_call(forward, module, args, kwargs)
        self.site.at_forward(self, args, kwargs)  # after the pre-hooks: NOTE [ Module instances ] in _sites/targets.py
        try:
            if own is None:
                return type(module).forward(module, *args, **kwargs)
            return own(*args, **kwargs)
        except Exception:
            raise  # torch runs the module's always-called forward hooks: the site's closes it
        except BaseException:  # a KeyboardInterrupt, which torch runs no hook for: closed here
            self.site.abandon(module)
            raise

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """The forward this one calls, bound to the module: what `inspect.signature` reads."""
        if self.own is not None:
            return self.own
        module = self.module()
        return type(module).forward.__get__(module, type(module))  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        if name in _DELEGATED:  # as a bound method answers them
            return getattr(self.__wrapped__, name)
        raise AttributeError(f"'SiteForward' object has no attribute '{name}'")

    def __reduce__(self) -> tuple[Any, ...]:
        return (SiteForward, (self.module(), self.own, self.site))


_DELEGATED = frozenset({
    "__annotations__", "__code__", "__defaults__", "__func__", "__kwdefaults__", "__name__", "__qualname__",
    "__self__",
})
def _call_own(own: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`own(*args, **kwargs)` in the shape of `type(module).forward(module, *args, **kwargs)`."""
    del module
    return own(*args, **kwargs)


def route_module(module: torch.nn.Module, site: Any) -> None:
    """Give `module` its own `forward`, a `SiteForward` that reaches `site` under compile (see `unroute_module`)."""
    unroute_module(module)
    module.__dict__["forward"] = SiteForward(module, module.__dict__.get("forward"), site)


def unroute_module(module: torch.nn.Module) -> None:
    """Give `module` back the forward it had before `route_module`: none of its own, or the one it had."""
    routed = module.__dict__.get("forward")
    if isinstance(routed, SiteForward):
        if routed.own is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = routed.own
