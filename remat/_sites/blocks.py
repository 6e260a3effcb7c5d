"""Which blocks of a model `remat.apply(model)` rematerializes when no `where` is given.

See NOTE [ Picking blocks ].
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

__all__ = ["describe_search", "describe_unreached", "find_blocks", "is_hf_layer"]

# NOTE [ Picking blocks ]
# 1. On a Hugging Face model the blocks are the layers its own gradient checkpointing wraps (in transformers 5 the
#    instances of `transformers.modeling_layers.GradientCheckpointingLayer`).
# 2. Elsewhere they are the repeated blocks of one class: the children of every `nn.ModuleList`/`nn.Sequential`
#    whose children all share one class, gathered by that class over all such containers (stages that each hold a
#    few blocks give all the blocks). A child that is itself an `nn.ModuleList` or `nn.ModuleDict` is never called,
#    so its own children stand in its place; a parametrization's list (`parametrizations.weight`, as weight norm
#    makes) is never a container of blocks.
# 3. Of each class, the blocks that lie inside a block of another class are left out (the experts of a layer, the
#    blocks of a stage held in a list of stages: the outer ones count). The class with the most blocks left is
#    picked, the first found in `named_modules()` order on a tie, and one of torch's layers of one op (`Linear`, the
#    convolutions, `Embedding`: each saves only its input and weight, so rematerializing it frees nothing) only
#    where no other class is left.
# 4. Blocks inside a chosen block are never chosen too.
#
# Implementation notes:
# 1. (rule 1) The class is found by its module and name along the MRO, so transformers is never imported here.
# 2. (rules 2, 3) Before, the pick was the longest single container: one stage of a ResNet (2 of 8 blocks in
#    resnet18, 6 of 16 in resnet50), the inner lists of a list of lists (transformers' Funnel: no forward calls a
#    list, so nothing was rematerialized), weight norm's parametrization (EnCodec), or a Res2Net block's list of
#    seven `Conv2d` (nothing to rebuild): each without a word.

# torch's layers of one op whose backward needs only their input and weight: nothing to rebuild (rule 3)
_LONE_OPS = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.Embedding, nn.EmbeddingBag, nn.Identity,
)
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
    groups: dict[type[nn.Module], dict[str, nn.Module]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or isinstance(module, ParametrizationList):
            continue
        members = _called(f"{name}." if name else "", module)
        kinds = {type(member) for _, member in members}
        if len(kinds) == 1:  # rule 2
            groups.setdefault(kinds.pop(), {}).update(members)
    kind_of = {name: kind for kind, group in groups.items() for name in group}
    outer = [  # rule 3: each class's blocks that lie inside no block of another class
        kept for kind, group in groups.items()
        if (kept := {name: block for name, block in group.items() if not _inside(name, kind, kind_of)})
    ]
    blocks = [group for group in outer if not isinstance(next(iter(group.values())), _LONE_OPS)]
    best = max(blocks or outer, key=len, default={})  # the first of the longest; its blocks in `named_modules()` order
    return _outermost(list(best.items()))


def _inside(name: str, kind: type[nn.Module], kind_of: dict[str, type[nn.Module]]) -> bool:
    """Whether the block `name` (of class `kind`) lies inside a block of another class (`kind_of`: each block's)."""
    parts = name.split(".")
    return any(kind_of.get(".".join(parts[:end]), kind) is not kind for end in range(1, len(parts)))


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


def describe_unreached(model: nn.Module, names: Sequence[str], did: str, so: str) -> str:
    """The message for `model`'s blocks `names`, none of which its forward called as a module (NOTE [ Blocks that
    forward never calls ] in unreached.py): what apply `did` with them, and `so`, what that means."""
    shown = ", ".join(f"`{name or '(the model)'}`" for name in names[:3]) + (", ..." if len(names) > 3 else "")
    count = f"{len(names)} block" + ("s" if len(names) > 1 else "")
    return (f"remat: apply {did} {count} of `{type(model).__name__}` ({shown}), but its first training forward "
            "called none of them as a module (`block(x)`; a call through another method, such as `block.encode(x)` or "
            f"`block.forward(x)`, skips the hooks), so {so}. Name blocks that forward calls, "
            "`remat.apply(model, where=...)`, or decorate the method it calls with `@remat`.")
