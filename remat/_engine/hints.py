"""What a recompute mismatch error can say about its likely cause, from what the site was called with.

See NOTE [ Mismatch hints ].
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["Attributes", "attributes", "explain"]

# NOTE [ Mismatch hints ]
# 1. A recompute mismatch of a rerun site names, with the fix, the two common causes visible from the site: a cache
#    object among the arguments (a class named `...Cache` with an `update` method, as transformers' caches are) or
#    `use_cache=True`; and a module whose Python attributes changed when it ran (a counter, a flag, a cached tensor).
# 2. Forward pays nothing for the hints.
# 3. A container grown in place (a list appended to) keeps its identity and is not named.
#
# Implementation notes:
# 1. (rule 1) A rerun mismatch almost always means other Python ran: the function changed state it reads. Recompute
#    repeats forward's writes, so comparing each module attribute's identity before recompute with that when the
#    mismatch is found shows them.
# 2. (rule 2) The snapshot (the attribute tables' values, held only until recompute ends well) is taken in backward.

_MODULE_OWN = frozenset(nn.Module().__dict__)  # torch's bookkeeping: hooks, parameters, buffers, `training`
Attributes = list[tuple[nn.Module, tuple[str, ...], list[Any]]]


def attributes(module: nn.Module) -> Attributes:
    """The Python attributes of `module` and its submodules: per module, its names and their values."""
    found: Attributes = []
    stack = [module]
    while stack:  # a plain walk: `named_modules` builds every qualified name, which costs more than the rest
        sub = stack.pop()
        own = sub.__dict__
        found.append((sub, tuple(own), list(own.values())))
        stack.extend(child for child in sub._modules.values() if child is not None)
    return found


def _changed(module: nn.Module, before: Attributes) -> list[str]:
    names = {id(sub): name for name, sub in module.named_modules(remove_duplicate=False)}
    found = []
    for sub, keys, values in before:
        then = {key: value for key, value in zip(keys, values, strict=True) if key not in _MODULE_OWN}
        now = {key: value for key, value in sub.__dict__.items() if key not in _MODULE_OWN}
        prefix = names.get(id(sub), "")
        for key in sorted(then.keys() | now.keys()):
            if key not in now or key not in then or now[key] is not then[key]:
                found.append(f"{prefix}.{key}" if prefix else key)
    return sorted(found)


def _is_cache(value: Any) -> bool:
    kind = type(value)
    return "Cache" in kind.__name__ and callable(getattr(kind, "update", None))


def _cache_kwargs(args: Any, kwargs: Any) -> list[str]:
    found = []
    named = [(f"positional argument #{index}", value) for index, value in enumerate(args or ())]
    named += list((kwargs or {}).items())
    for name, value in named:
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if _is_cache(item):
                found.append(f"`{name}` (a `{type(item).__name__}`)")
                break
    return found


def explain(args: Any, kwargs: Any, module: nn.Module | None, before: Attributes | None) -> str:
    """Sentences naming the likely cause of a rerun mismatch, each with its fix; "" when none is seen.

    Args:
        args: the positional arguments the site was called with.
        kwargs: its keyword arguments.
        module: the module whose forward the site runs, or None.
        before: `attributes(module)` taken before recompute, or None.

    >>> class DynamicCache:
    ...     def update(self, keys, values): ...
    >>> explain((), {"past_key_values": DynamicCache()}, None, None).split(":")[0]
    ' It was called with a cache object, `past_key_values` (a `DynamicCache`)'
    """
    sentences = []
    caches = _cache_kwargs(args, kwargs)
    if caches:
        sentences.append(
            f"It was called with a cache object, {', '.join(caches)}: rerun calls it again in backward, which "
            "updates the cache a second time. Pass no cache in training (`use_cache=False`), or use "
            "strategy='replay', which does not run Python again."
        )
    elif kwargs and kwargs.get("use_cache") is True:
        sentences.append(
            "It was called with `use_cache=True`: a cache it builds or updates changes between forward and "
            "recompute. Pass `use_cache=False` in training, or use strategy='replay'."
        )
    if module is not None and before is not None:
        changed = _changed(module, before)
        if changed:
            names = ", ".join(f"`{name}`" for name in changed[:5]) + (", ..." if len(changed) > 5 else "")
            sentences.append(
                f"Recompute changed Python attributes of `{type(module).__qualname__}` ({names}): a module "
                "that writes its own state when it runs sees other state in recompute than in forward. Keep "
                "that state out of forward, or use strategy='replay'."
            )
    return "".join(" " + sentence for sentence in sentences)
