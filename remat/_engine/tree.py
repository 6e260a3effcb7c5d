"""Find and replace tensors anywhere in call arguments: tuples, lists, dicts, namedtuples, dataclasses."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["map_tensors", "tensors_in"]

_Tensor = torch.Tensor


def tensors_in(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Append every tensor inside `obj` to `out`, depth first, and return `out`."""
    if isinstance(obj, _Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            if isinstance(item, _Tensor):  # the common leaf, without a call (a site's arguments, every call)
                out.append(item)
            else:
                tensors_in(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            tensors_in(item, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            tensors_in(getattr(obj, field.name), out)
    return out


def map_tensors(obj: Any, fn: Callable[[Any], Any], leaf: type = _Tensor) -> Any:
    """Return `obj` with every tensor `t` inside replaced by `fn(t)`; containers are rebuilt, others kept.

    `leaf` is the type of what is replaced (tensors unless told otherwise).
    """
    if isinstance(obj, leaf):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [map_tensors(item, fn, leaf) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return type(obj)(map_tensors(item, fn, leaf) for item in obj)
    if isinstance(obj, dict):
        mapped = type(obj)()
        for key, item in obj.items():
            mapped[key] = map_tensors(item, fn, leaf)
        return mapped
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn, leaf) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj
