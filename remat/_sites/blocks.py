"""Which blocks of a model `remat.apply(model)` rematerializes when no `where` is given.

See NOTE [ Picking blocks ].
"""

from __future__ import annotations

from torch import nn

__all__ = ["describe_search", "find_blocks", "is_hf_layer"]

# NOTE [ Picking blocks ]
# 1. On a Hugging Face model the blocks are the layers its own gradient checkpointing wraps (in transformers 5 the
#    instances of `transformers.modeling_layers.GradientCheckpointingLayer`).
# 2. Elsewhere they are the children of the longest `nn.ModuleList`/`nn.Sequential` whose children all share one
#    class (the first such container in `named_modules()` order on a tie).
# 3. Blocks inside a chosen block are never chosen too.
#
# Implementation notes:
# 1. (rule 1) The class is found by its module and name along the MRO, so transformers is never imported here.

_HF_LAYER = ("transformers.modeling_layers", "GradientCheckpointingLayer")


def is_hf_layer(module: nn.Module) -> bool:
    """Whether `module` is a transformers layer that its own gradient checkpointing would wrap."""
    return any((kind.__module__, kind.__qualname__) == _HF_LAYER for kind in type(module).__mro__)


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in found:
        if not any(name.startswith(outer + ".") for outer, _ in chosen):
            chosen.append((name, module))
    return chosen


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The `(qualified name, module)` pairs a user would rematerialize, in `named_modules()` order.

    Returns an empty list when the model has neither transformers layers nor a container of repeated blocks.
    """
    layers = [(name, module) for name, module in model.named_modules() if is_hf_layer(module)]
    if layers:
        return _outermost(layers)
    best: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) > len(best) and len({type(child) for _, child in children}) == 1:
            prefix = f"{name}." if name else ""
            best = [(prefix + child_name, child) for child_name, child in children]
    return best


def describe_search(model: nn.Module) -> str:
    """What `find_blocks` looked for, for the error raised when it finds nothing."""
    return (
        f"remat: apply found no blocks to rematerialize in `{type(model).__qualname__}`: it looked for "
        "transformers layers (GradientCheckpointingLayer) and for an nn.ModuleList or nn.Sequential whose "
        "children share one class. Name the blocks with `remat.apply(model, BlockClass)` or a predicate "
        "`(name, module) -> bool`."
    )
