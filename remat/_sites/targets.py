"""What `@remat` can decorate: functions and methods, `nn.Module` classes, and module instances.

See NOTE [ Module instances ].
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from .._core import switch as _switch
from .._core.errors import check_runs_when_called
from .._core.options import Options
from .._core.policies import as_policy
from .._engine import region as _region
from .._engine import rerun as _rerun
from .._engine.compiled import (
    SiteForward,
    compiled_key,
    compiling,
    context_for,
    route_module,
    torch_checkpoint,
    unroute_module,
)
from .._engine.offload import resolve as resolve_offload
from .blocks import describe_search, find_blocks
from .head import describe_head
from .integrations import comes_from
from .table import OFFLOADED, ModelPlan, Site, TiledModule

if TYPE_CHECKING:
    from .._core.requests import Where

__all__ = ["apply_blocks", "model_plan", "opener_of", "remove_hooks", "select", "set_aside", "undo_sites", "wrap",
           "wrap_class", "wrap_function", "wrap_module"]


_M = TypeVar("_M", bound=nn.Module)
_F = TypeVar("_F", bound=Callable[..., Any])
_MARK = "__remat_options__"


class _Engine:
    """The strategy's entry points, resolved once when a site is made.

    `open(fn, args, kwargs, module=...)` starts a site's forward with its options bound (a `functools.partial`,
    so a call pays no keyword expansion in Python: it is on the path of every call) and returns the token
    for `end(token, ok=...)`.
    """

    __slots__ = ("end", "keywords", "open", "passthrough")

    def __init__(self, options: Options, site: str) -> None:
        policy = as_policy(options.policy)
        self.passthrough = policy.everything
        extra: dict[str, Any] = {
            "policy": None if policy.saves_nothing else policy,
            "offload": resolve_offload(options.offload),
            "site": site,
            "check": options.check,
            "preserve_rng": options.preserve_rng,
            "debug": options.debug or _switch.debug(),
        }
        # Inside a compiled frame: torch's checkpoint with the policy's context (NOTE [ Under torch.compile ]).
        self.keywords: dict[str, Any] = {
            "context_fn": context_for(policy, site, options.offload is not False),
            "preserve_rng_state": options.preserve_rng,
            "key": compiled_key(policy),  # NOTE [ Guarding on the policy ]
        }
        if options.strategy == "replay":
            self.open: Callable[..., Any] = functools.partial(_open_region, **extra)
            self.end: Callable[..., None] = _region.end_replay
        else:
            self.open = functools.partial(_rerun.begin, early_stop=True, **extra)
            self.end = _rerun.end


def _open_region(fn: Any, args: Any, kwargs: Any, **options: Any) -> object:
    """`region.begin_replay` in the shape of `rerun.begin`: a replay site records whatever runs next."""
    del fn, args, kwargs
    return _region.begin_replay(**options)


def _active(options: Options) -> bool:
    return options.active(_switch._state[0]) and torch.is_grad_enabled()


def wrap_function(fn: _F, options: Options, site: str | None = None, adapt: Any = None) -> _F:
    """Return `fn` rematerialized: a plain function (so methods bind and dynamo can trace it).

    `adapt(module, args, kwargs)`, for a method, may change the arguments of an active call (see _cache_rule).
    """
    if isinstance(fn, (staticmethod, classmethod)):
        return type(fn)(wrap_function(fn.__func__, options, site))
    name = options.name or site or getattr(fn, "__qualname__", None) or repr(fn)
    check_runs_when_called(fn, name)
    engine = _Engine(options, name)
    open_site, end, enabled, switch = engine.open, engine.end, options.enabled, _switch._state
    keywords = engine.keywords
    if engine.passthrough:  # save_all keeps every activation: nothing to rematerialize
        enabled = False

    @functools.wraps(fn)
    def remat_wrapper(*args: Any, **kwargs: Any) -> Any:
        if not (switch[0] if enabled is None else enabled) or not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        module = args[0] if args and isinstance(args[0], nn.Module) else None
        if compiling():  # see NOTE [ Under torch.compile ]
            if adapt is not None and module is not None:  # NOTE [ Caches under torch.compile ]
                changed = adapt.compiled(module, args[1:], kwargs)
                if changed is not None:
                    args, kwargs = (module, *changed[0]), changed[1]
            return torch_checkpoint(fn, args, kwargs, **keywords)
        if adapt is not None and module is not None:
            changed = adapt(module, args[1:], kwargs)
            if changed is not None:
                args, kwargs = (module, *changed[0]), changed[1]
        token = open_site(fn, args, kwargs, module=module)
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            end(token, ok=False)
            raise
        end(token)
        return out

    setattr(remat_wrapper, _MARK, options)
    return remat_wrapper  # type: ignore[return-value]


def wrap_class(cls: type[_M], options: Options) -> type[_M]:
    """Rematerialize every instance's `forward`; the class stays itself (isinstance, pickling hold)."""
    forward = cls.forward
    forward = getattr(forward, "__wrapped__", forward) if hasattr(forward, _MARK) else forward
    cls.forward = wrap_function(forward, options, site=cls.__qualname__, adapt=_cache_rule(cls, options, cls))
    return cls


# NOTE [ Module instances ]
# 1. `remat(module)` leaves the object itself untouched: same type, no wrapper in `named_modules()` or
#    `state_dict()`, and `deepcopy`, `pickle` and `.to()` unaffected; the class is not touched.
# 2. The region opens when forward starts, after every forward pre-hook (the user's, registered before or after
#    `remat(module)`), with the arguments they leave, and closes in a forward hook that runs before any other
#    forward hook and also when forward raises. A pre-hook's own ops run outside the region, as they do outside
#    `torch.utils.checkpoint` around the call.
# 3. Recompute calls `module.forward` itself, not `module(...)`, so other hooks are not run twice: it takes the
#    arguments forward took.
# 4. `remat.undo` gives the instance back exactly what it had.
#
# Implementation notes:
# 1. (rules 1, 2) Nothing is proxied: the close hook is prepended and `always_call`; the one attribute set is the
#    instance's own `forward`, which reaches the site under compile (NOTE [ Under torch.compile ]) and opens it in
#    eager code (`_Open.at_forward`). The pre-hook, registered as the site is made, runs before any pre-hook
#    registered later: where it opened the region itself (before), a later pre-hook's change of the arguments
#    (`args[0] * 1.5`, pruning's masked weight) was missing from recompute (silently wrong gradients under rerun),
#    and its ops were packed as the region's (a `RecomputeMismatchError` in backward). Where that forward is not
#    the site's (code set its own over it after remat: accelerate's hooks, which change the arguments and move the
#    weights before they call ours, and which recompute must run again with forward's arguments), the pre-hook
#    opens the region as before, and recompute calls that forward.
# 2. (rule 4) The hooks and that forward are small picklable objects that carry the options; `undo_sites` finds them
#    by type.
# 3. (rule 2) The placeholder the pre-hook pushes is stale where a `KeyboardInterrupt` in a later pre-hook ends the
#    call before forward (torch runs no always-called hook for it). So recompute calls what the routed forward
#    calls, never the routed forward: that would open a region inside the recompute for the stale placeholder;
#    and the module's next call replaces it.

class _Open:
    """Forward pre-hook that opens a region around `module.forward`."""

    def __init__(self, options: Options, site: str, adapt: Any = None) -> None:
        self.options = options
        self.site = site
        self.engine = _Engine(options, site)
        self.adapt = adapt  # changes the arguments of an active site: see _cache_rule
        self.ran = False  # called as a module once: NOTE [ Blocks that forward never calls ] in unreached.py

    def active(self) -> bool:
        """Whether a call now would open a region (eager, with grad, the site switched on and saving something)."""
        return not self.engine.passthrough and _active(self.options) and not compiling()

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        stack = _open_sites.stack
        if not self.active():
            stack.append((module, None, None))
            if not self.ran and not compiling():  # called as a module (under no_grad, say): NOTE [ Blocks that
                self.ran = True  # forward never calls ] in unreached.py
            return None
        changed = self.adapt(module, args, kwargs) if self.adapt is not None else None
        if changed is not None:
            args, kwargs = changed
        engine = self.engine
        routed = module.__dict__.get("forward")
        if type(routed) is SiteForward and routed.site is self:  # rule 2: opened by `at_forward`
            if stack and stack[-1][2] is _AT_FORWARD and stack[-1][0] is module:
                stack.pop()  # stale: implementation note 3
            stack.append((module, engine, _AT_FORWARD))
            return changed
        stack.append((module, engine, engine.open(module.forward, args, kwargs, module=module)))
        self.ran = True
        return changed

    def at_forward(self, routed: SiteForward, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Open the region the pre-hook left to forward (`routed`, the instance's), with the arguments forward takes
        (NOTE [ Module instances ], rule 2): eager code only, and only where this site's pre-hook has just run."""
        stack = _open_sites.stack
        engine = self.engine
        if stack and stack[-1][2] is _AT_FORWARD and stack[-1][1] is engine:
            module = stack[-1][0]
            # recompute calls what the routed forward calls, not the routed forward: implementation note 3
            call = routed.own if routed.own is not None else types.MethodType(type(module).forward, module)
            stack[-1] = (module, engine, engine.open(call, args, kwargs, module=module))
            self.ran = True

    def compiled_call(
        self, forward: Callable[..., Any], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """`forward(module, ...)` inside a compiled frame: torch's checkpoint (NOTE [ Under torch.compile ])."""
        if self.engine.passthrough or not _active(self.options):
            return forward(module, *args, **kwargs)
        if self.adapt is not None:  # NOTE [ Caches under torch.compile ] in integrations/transformers.py
            changed = self.adapt.compiled(module, args, kwargs)
            if changed is not None:
                args, kwargs = changed
        return torch_checkpoint(forward, (module, *args), kwargs, **self.engine.keywords)

    def abandon(self, module: nn.Module) -> None:
        """Close the region this hook opened for `module`, whose forward raised an exception that torch runs no
        always-called hook for (a `KeyboardInterrupt` is no `Exception`): the saved-tensor hooks and the replay's
        recorder would stay on for every later step of the process."""
        _Close()(module, (), None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Open, (self.options, self.site, self.adapt))


class _Close:
    """Forward hook that closes the region `_Open` opened, also when forward raised."""

    def __call__(self, module: nn.Module, args: Any, *rest: Any) -> None:
        # Called as (module, args, kwargs, output) after forward, as (module, args, None) when it raised.
        stack = _open_sites.stack
        if stack and stack[-1][0] is module:
            _, engine, token = stack.pop()
            if engine is not None and token is not _AT_FORWARD:  # a forward that raised before it opened
                engine.end(token, ok=len(rest) == 2)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Close, ())


_AT_FORWARD = object()  # the stack's token for a region that forward opens (`_Open.at_forward`)


class _OpenSites(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[nn.Module, _Engine | None, Any]] = []


_open_sites = _OpenSites()
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def opener_of(module: nn.Module) -> _Open | None:
    """The hook that opens `module`'s region, where `remat(module)` or `remat.apply` made it a site."""
    return next((hook for hook in module._forward_pre_hooks.values() if isinstance(hook, _Open)), None)


def _is_ours(hook: Any) -> bool:
    return isinstance(hook, (_Open, _Close)) or getattr(hook, "_remat_owned", False)


def _pop_ours(module: nn.Module) -> list[Any]:
    """Take remat's hooks out of every hook table of `module`; returns what the tables held for them."""
    ids = [key for name in ("_forward_pre_hooks", "_forward_hooks") for key, hook in getattr(module, name).items()
           if _is_ours(hook)]
    return [getattr(module, name).pop(key, None) for name in _HOOK_DICTS for key in ids]


def remove_hooks(module: nn.Module) -> None:
    for hook in _pop_ours(module):
        close = getattr(hook, "close", None)
        if callable(close):  # a budget's tracked step: NOTE [ The first step ] in remat/_budget/first_step.py
            close()
    unroute_module(module)


# NOTE [ A model set aside ]
# Rules:
# 1. `set_aside(model)` shows, for a while, the model as it was before remat: every hook remat registered on its
#    modules (sites, a routed head, a budget's hook) is out of their tables, and every instance attribute remat put
#    in front of the module's own (a site's, a tile's or a routed head's `forward`, the head's loss function) gives
#    way to the one it wraps. Nothing is closed: a budget's tracked step, a head's route are as they were.
# 2. On exit every module's hook tables and instance attributes are exactly what they were on entry (same hook
#    objects, same order, the user's own too), whatever ran in between added or took away.
#
# Implementation notes:
# 1. (rule 1) What remat wraps an instance attribute with is marked `_remat_owned` on its class and keeps what it
#    wraps as `own` (None: the class's own, so the attribute goes).


def _unwrapped(value: Any) -> Any:
    while getattr(type(value), "_remat_owned", False) and hasattr(value, "own"):
        value = value.own
    return value


@contextlib.contextmanager
def set_aside(model: nn.Module) -> Iterator[None]:
    """`model` without what remat put on it, for a while (NOTE [ A model set aside ])."""
    modules = list(model.modules())
    tables = [(table, dict(table)) for m in modules for table in (getattr(m, n) for n in _HOOK_DICTS)]
    attributes = [(m, dict(vars(m))) for m in modules]
    try:
        for module in modules:
            _pop_ours(module)
            own = vars(module)
            for name, value in list(own.items()):
                if (bare := _unwrapped(value)) is not value:
                    if bare is None:
                        del own[name]
                    else:
                        own[name] = bare
        yield
    finally:
        for table, saved in tables:
            table.clear()
            table.update(saved)
        for module, before in attributes:
            own = vars(module)
            for name in set(own) - set(before):
                del own[name]
            own.update(before)


_RULES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # owner -> its one cache rule


def _cache_rule(kind: type, options: Options, owner: Any) -> Any:
    """The KV-cache rule for a transformers layer class under rerun, else None; see NOTE [ Caches of transformers
    layers ] in integrations/transformers.py. One rule per `owner` (a model, a layer class) for its life, so
    that it logs its one line once, however often it is applied (and through every round of a budget's profile)."""
    if options.strategy == "replay" or not comes_from(kind, "transformers"):
        return None
    rule = _RULES.get(owner)
    if rule is None:
        from .integrations.transformers import CacheOff

        rule = _RULES[owner] = CacheOff()
    rule.know(kind)
    return rule


def wrap_module(module: _M, options: Options, owner: nn.Module | None = None) -> _M:
    """Rematerialize `module`'s forward in place and return the same object (`owner`: the model whose layers
    share one cache rule; the module itself by default)."""
    if hasattr(type(module).forward, _MARK):
        return module  # the class is rematerialized already
    remove_hooks(module)
    site = options.name or type(module).__qualname__
    # A layer rematerialized alone (`remat(layer)` in a loop over a model's layers) shares its class's rule, so
    # the loop logs one line, not one per layer.
    adapt = _cache_rule(type(module), options, type(module) if owner is None else owner)
    opener = _Open(options, site, adapt)
    module.register_forward_pre_hook(opener, with_kwargs=True)
    route_module(module, opener)  # hooks cannot wrap a compiled call: NOTE [ Under torch.compile ]
    module.register_forward_hook(_Close(), with_kwargs=True, always_call=True, prepend=True)
    return module


def wrap(target: Any, options: Options) -> Any:
    """Dispatch on what `target` is; see the module docstring."""
    if isinstance(target, type):
        if not issubclass(target, nn.Module):
            raise TypeError(
                f"remat: @remat on a class needs an nn.Module subclass, but got `{target.__qualname__}`; "
                "decorate its methods instead."
            )
        return wrap_class(target, options)
    if isinstance(target, nn.Module):
        return wrap_module(target, options)
    if callable(target) or isinstance(target, (staticmethod, classmethod)):
        return wrap_function(target, options)
    raise TypeError(
        "remat: @remat expects a function, a method, an nn.Module class or an nn.Module instance, "
        f"but got `{type(target).__name__}`."
    )


def undo_sites(module: _M) -> _M:
    """Remove what `remat(module)` and `remat.apply` added to `module` and its submodules (hooks, the instance's
    own `forward`), leaving each as it was before."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"remat: undo expects an nn.Module, but got `{type(module).__name__}`.")
    for submodule in module.modules():
        remove_hooks(submodule)
        if "forward" in submodule.__dict__:  # a tiled module's own forward: NOTE [ What is tiled ] in tiles.py
            from .tiles import untile

            untile(submodule)
    return module


def apply_blocks(
    model: nn.Module,
    where: Where | None,
    every: int,
    options: Options,
) -> list[str]:
    """Rematerialize each `every`-th submodule of `model` that `where` selects; see `remat.apply` (whose request
    checked the arguments: remat/_core/requests.py). Returns their qualified names."""
    chosen = select(model, where)[::every]
    for _, module in chosen:
        wrap_module(module, options, model)
    return [name for name, _ in chosen]


def select(
    model: nn.Module,
    where: Where | None,
) -> list[tuple[str, nn.Module]]:
    """The outermost submodules `where` selects (see NOTE [ Picking blocks ] when it is None)."""
    if where is None:
        blocks = find_blocks(model)
        if not blocks:
            raise ValueError(describe_search(model))
        return blocks
    if isinstance(where, type) or (
        isinstance(where, tuple) and all(isinstance(kind, type) for kind in where)
    ):
        kinds = where

        def select(name: str, module: nn.Module) -> bool:
            return isinstance(module, kinds)
    elif callable(where):
        select = where  # type: ignore[assignment]
    else:
        raise TypeError(
            "remat: `where` must be an nn.Module type, a tuple of types or a predicate "
            f"(name, module) -> bool, but got `{type(where).__name__}`."
        )
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(outer + ".") or outer == "" for outer, _ in chosen)
        if not inside and select(name, module):
            chosen.append((name, module))
    if not chosen:
        raise ValueError(
            f"remat: apply found no submodule of `{type(model).__qualname__}` matching {where!r}."
        )
    return chosen


def describe_options(options: Options) -> str:
    """How a site is rematerialized, in a word or two: `full`, a policy's name, `replay`."""
    policy = as_policy(options.policy)
    choice = "full" if policy.saves_nothing else repr(policy)
    if options.strategy == "replay":
        choice += " (replay)"
    if options.offload is not False:
        choice += OFFLOADED
    if options.enabled is False:
        choice += " (disabled)"
    return choice


def _decorated_methods(kind: type[nn.Module]) -> list[tuple[str, Options]]:
    """The methods of a module class other than `forward` that `@remat` decorated, as the class resolves them (a
    subclass's own definition hides its base's)."""
    seen: set[str] = set()
    found: list[tuple[str, Options]] = []
    for klass in kind.__mro__:
        if klass is nn.Module or klass is object:
            continue
        for attr, value in vars(klass).items():
            if attr in seen:
                continue
            seen.add(attr)
            options = getattr(getattr(value, "__func__", value), _MARK, None)  # static and class methods too
            if attr != "forward" and isinstance(options, Options):
                found.append((attr, options))
    return found


def model_plan(model: nn.Module) -> ModelPlan:
    """The rematerialized sites of `model`: module instances (`remat(module)`, `remat.apply`), classes, and the
    methods of their classes decorated with `@remat`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"remat: plan expects an nn.Module, but got `{type(model).__name__}`.")
    sites: list[Site] = []
    methods: dict[type, list[tuple[str, Options]]] = {}
    for name, module in model.named_modules():
        kind = type(module).__qualname__
        options = getattr(type(module).forward, _MARK, None)
        if options is None:
            options = next((hook.options for hook in module._forward_pre_hooks.values() if isinstance(hook, _Open)),
                           None)
        if options is not None:
            sites.append(Site(name, kind, describe_options(options), label=options.name))
        if type(module) not in methods:
            methods[type(module)] = _decorated_methods(type(module))
        for method, options in methods[type(module)]:
            sites.append(Site(name, kind, describe_options(options), method=method, label=options.name))
    head = describe_head(model)
    tiles = _tiles_of(model)
    hooks: list[Any] = list(model._forward_pre_hooks.values())
    budget = next((hook.assignment for hook in hooks if _is_ours(hook)
                   and getattr(hook, "assignment", None) is not None), None)  # see remat/_budget/driver.py
    if budget is not None:
        classes = tuple(type(model.get_submodule(name)).__qualname__ for name in budget.cost.names)
        off = not _switch.is_enabled()
        return ModelPlan(type(model).__qualname__, tuple(sites), budget, classes, switched_off=off, head=head,
                         tiles=tiles)
    return ModelPlan(type(model).__qualname__, tuple(sites), switched_off=not _switch.is_enabled(), head=head,
                     tiles=tiles)


def _tiles_of(model: nn.Module) -> tuple[TiledModule, ...]:
    """The model's tiled modules (a tiled module has its own `forward`: NOTE [ What is tiled ] in tiles.py)."""
    found: list[TiledModule] = []
    for name, module in model.named_modules():
        if "forward" not in module.__dict__:
            continue
        from .tiles import tiled_of  # with the first tiled module: `import remat` stays cheap

        tiled = tiled_of(module)
        if tiled is not None:
            found.append(TiledModule(name, tiled.tiles, tiled.chosen_by))
    return tuple(found)
