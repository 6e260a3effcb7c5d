"""Which blocks of a model `remat.apply(model)` rematerializes when no `where` is given.

See NOTE [ Picking blocks ].
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

__all__ = ["describe_search", "find_blocks", "is_hf_layer"]

# NOTE [ Picking blocks ]
# 1. On a Hugging Face model the blocks are the layers its own gradient checkpointing wraps (in transformers 5 the
#    instances of `transformers.modeling_layers.GradientCheckpointingLayer`).
# 2. Elsewhere they are the children of the longest `nn.ModuleList`/`nn.Sequential` whose children all share one
#    class (the first such container in `named_modules()` order on a tie). A child that is itself an
#    `nn.ModuleList` or `nn.ModuleDict` is never called, so its own children stand in its place (a list of stages,
#    each a list of layers, gives the layers); a parametrization's list (`parametrizations.weight`, as weight norm
#    makes) is never a container of blocks.
# 3. Blocks inside a chosen block are never chosen too.
#
# Implementation notes:
# 1. (rule 1) The class is found by its module and name along the MRO, so transformers is never imported here.
# 2. (rule 2) Before, a list of lists gave the inner lists, and weight norm's list its parametrization: sites that
#    no forward calls, so `remat.apply(model)` rematerialized nothing and said nothing (transformers' Funnel,
#    EnCodec).

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
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or isinstance(module, ParametrizationList):
            continue
        members = _called(f"{name}." if name else "", module)
        if len(members) > len(best) and len({type(member) for _, member in members}) == 1:
            best = members
    return best


def _called(prefix: str, container: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of `container` by qualified name, a list or dict among them (never called) replaced by its own
    children (NOTE [ Picking blocks ], rule 2)."""
    found: list[tuple[str, nn.Module]] = []
    for name, child in container.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            found += _called(f"{prefix}{name}.", child)
        else:
            found.append((prefix + name, child))
    return found


def describe_search(model: nn.Module) -> str:
    """What `find_blocks` looked for, for the error raised when it finds nothing."""
    return (
        f"remat: apply found no blocks to rematerialize in `{type(model).__qualname__}`: it looked for "
        "transformers layers (GradientCheckpointingLayer) and for an nn.ModuleList or nn.Sequential whose "
        "children share one class. Name the blocks with `remat.apply(model, BlockClass)` or a predicate "
        "`(name, module) -> bool`."
    )
