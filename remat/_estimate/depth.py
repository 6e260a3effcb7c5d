"""A model's identical layers, and the model cut to its first few of them for a while: the estimates in depth of
NOTE [ Searching the largest batch ] (rule 5).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from .._sites.blocks import find_blocks

__all__ = ["Layers", "identical_layers"]


class Layers:
    """The container of a model's identical layers (an ``nn.ModuleList`` or ``nn.Sequential`` of one class, every
    layer with the same parameters' and buffers' names, shapes and dtypes), and how many it holds."""

    def __init__(self, container: nn.Module) -> None:
        self.container = container
        self.depth = len(container._modules)

    @contextlib.contextmanager
    def cut(self, depth: int | None) -> Iterator[None]:
        """The model with its first ``depth`` layers only while inside (all of them for None): the container's
        other layers are taken out of it, so a loop over the container (``for layer in self.layers``,
        ``self.layers[:n]``, ``nn.Sequential``'s forward) runs the first ``depth``; put back as they were on
        exit."""
        if depth is None or depth >= self.depth:
            yield
            return
        saved = self.container._modules
        self.container._modules = dict(list(saved.items())[:depth])
        try:
            yield
        finally:
            self.container._modules = saved


def _layer_shape(module: nn.Module) -> tuple[object, ...]:
    """What two identical layers share: their class, and each parameter's and buffer's name, shape and dtype."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (type(module), tuple((name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in tensors))


def identical_layers(model: nn.Module) -> Layers | None:
    """The container of the model's blocks (`find_blocks`) where it holds only them and they are identical in
    everything but their values; None otherwise."""
    blocks = find_blocks(model)
    if not blocks:
        return None
    name = blocks[0][0].rpartition(".")[0]
    try:
        container = model.get_submodule(name)
    except AttributeError:
        return None
    children = list(container.children())
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(children) != len(blocks) or any(
            child is not block for child, (_, block) in zip(children, blocks, strict=True)):
        return None
    first = _layer_shape(children[0])
    if any(_layer_shape(child) != first for child in children[1:]):
        return None
    return Layers(container)
