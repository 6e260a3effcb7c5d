"""`remat.apply(model, head=True)`: a language model's loss through `remat.linear_cross_entropy`, in chunks.

The model-specific part (finding the head, routing its loss) lives in an integration, imported only when a model
asks for it: `integrations/causal_lm.py` for Hugging Face causal LMs (NOTE [ A causal LM's head ] there).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .integrations import comes_from

__all__ = ["can_route_head", "describe_head", "route_head", "routed_by", "switch_head", "unroute_head"]


def route_head(model: nn.Module, chosen_by: str | None = None) -> Any:
    """Route the loss of the language model inside `model` through `linear_cross_entropy` (a ValueError naming
    what was looked for when it has none); a route already there is replaced. `chosen_by` says who chose it, where
    not the user (`remat.plan` shows it). Returns the route (the model's forward pre-hook)."""
    from .integrations.causal_lm import route

    return route(model, chosen_by)


def can_route_head(model: nn.Module) -> bool:
    """Whether `route_head(model)` would route a head (without routing it)."""
    if not any(comes_from(type(module), "transformers") for module in model.modules()):
        return False
    from .integrations.causal_lm import check

    try:
        check(model)
    except ValueError:
        return False
    return True


def _routes(model: nn.Module, on: bool | None = True) -> list[tuple[nn.Module, Any]]:
    """The routes inside `model` (those switched `on`, or off; every one for None)."""
    return [(module, hook) for module in model.modules() for hook in module._forward_pre_hooks.values()
            if getattr(hook, "remat_head", False) and on in (None, getattr(hook, "on", True))]


def switch_head(model: nn.Module, on: bool) -> None:
    """Switch the routes inside `model` off (the model's own head and loss, the routes left in place) or back on: a
    budget's re-plan chooses the head again without taking off the model a route that the forward it runs in has
    already read (NOTE [ The head as a choice ], implementation note 4)."""
    for _, hook in _routes(model, on=None):
        hook.on = on


def unroute_head(model: nn.Module) -> None:
    """Take every route `route_head` put inside `model` off it (`remat.undo` does the same for every hook)."""
    routes = _routes(model, on=None)
    if routes:
        from .integrations.causal_lm import unroute

        for module, _ in routes:
            unroute(module)


def routed_by(model: nn.Module) -> str | None:
    """Who chose the route inside `model`: "the user" (`head=True`), what `route_head` was told, or None (no
    route)."""
    for _, hook in _routes(model):
        return getattr(hook, "chosen_by", None) or "the user"
    return None


def describe_head(model: nn.Module) -> str | None:
    """One line for `remat.plan(model)` on a routed head, or None."""
    for _, hook in _routes(model):
        return str(hook.describe())
    return None
