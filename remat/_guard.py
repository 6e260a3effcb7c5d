"""Keep recompute from writing to tensors that live outside it (spec §3.4, side effects once).

See NOTE [ Writes during recompute ].
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OutsideWrites"]

# NOTE [ Writes during recompute ]
# Forward already applied every in-place update to state that outlives the region: BatchNorm's running
# statistics and `num_batches_tracked`, a user's accumulator, a buffer. Recompute must compute the same values
# without applying those updates a second time (torch.utils.checkpoint applies them twice, pytorch issue 96136).
# While recompute runs, this mode remembers the storage of every tensor an op makes; an op whose schema
# writes to an argument whose storage was not made during recompute runs on a clone of that argument instead.
# The forward path pays nothing: the mode exists only while recompute runs.

_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def _written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    found = _WRITES.get(func)
    if found is None:
        found = tuple(
            (position, argument.name)
            for position, argument in enumerate(func._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        )
        _WRITES[func] = found
    return found


def _storage_key(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


class OutsideWrites(TorchDispatchMode):  # type: ignore[misc]
    """Redirect in-place writes to tensors from outside the recompute onto clones."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.made: set[int] = set()

    def _outside(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and _storage_key(value) not in self.made

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        writes = _written_arguments(func)
        if writes:
            args = list(args)
            for position, name in writes:
                if position < len(args) and self._outside(args[position]):
                    args[position] = args[position].clone()
                elif name in kwargs and self._outside(kwargs[name]):
                    kwargs = {**kwargs, name: kwargs[name].clone()}
        out = func(*args, **kwargs)
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.made.add(_storage_key(tensor))
        return out
