"""`remat.apply(model, head=True)`: a language model's loss through `remat.linear_cross_entropy`, in chunks.

The model-specific part (finding the head, routing its loss) lives in an integration, imported only when a model
asks for it: `integrations/causal_lm.py` for Hugging Face causal LMs (NOTE [ A causal LM's head ] there).
"""

from __future__ import annotations

from torch import nn

__all__ = ["describe_head", "route_head", "unroute_head"]


def route_head(model: nn.Module) -> None:
    """Route the loss of the language model inside `model` through `linear_cross_entropy` (a ValueError naming
    what was looked for when it has none); a route already there is replaced."""
    from .integrations.causal_lm import route

    route(model)


def _routes(model: nn.Module) -> list[tuple[nn.Module, object]]:
    return [(module, hook) for module in model.modules() for hook in module._forward_pre_hooks.values()
            if getattr(hook, "remat_head", False)]


def unroute_head(model: nn.Module) -> None:
    """Take every route `route_head` put inside `model` off it (`remat.undo` does the same for every hook)."""
    routes = _routes(model)
    if routes:
        from .integrations.causal_lm import undo

        for module, _ in routes:
            undo(module)


def describe_head(model: nn.Module) -> str | None:
    """One line for `remat.plan(model)` on a routed head, or None."""
    for _, hook in _routes(model):
        return str(hook.describe())  # type: ignore[attr-defined]
    return None
