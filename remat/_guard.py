"""Keep recompute from writing to tensors that live outside it (spec §3.4, side effects once).

See NOTE [ Writes during recompute ].
"""

from __future__ import annotations

from typing import Any

import torch

from ._modes import Mode

__all__ = ["OutsideWrites", "written_arguments"]

# NOTE [ Writes during recompute ]
# Forward already applied every in-place update to state that outlives the region: BatchNorm's running
# statistics and `num_batches_tracked`, a user's accumulator, a buffer. Recompute must compute the same values
# without applying those updates a second time (torch.utils.checkpoint applies them twice, pytorch issue 96136).
# While recompute runs, this mode remembers the memory of every tensor an op makes (ops whose outputs alias an
# input, views and in-place ops, make nothing new); an op whose schema writes to an argument whose memory was
# not made during recompute runs on a clone of that argument instead. A tensor's memory is named by the data
# pointer of its base, so views of a tensor made inside count as inside and views of outside ones as outside.
# The forward path pays nothing: the mode exists only while recompute runs.
# Some ops write to arguments that their schema does not mark as written: `native_batch_norm` (and its cuDNN
# and MIOpen forms) updates `running_mean` and `running_var` in training, yet declares them `Tensor?`. Those
# writes are listed in `_UNDECLARED` by hand, or BatchNorm's statistics would be updated twice.

Writes = tuple[tuple[int, str], ...]
_Info = tuple[Writes, bool]
_BN_STATS = ("running_mean", "running_var")
_UNDECLARED = {
    "aten::native_batch_norm": _BN_STATS,
    "aten::cudnn_batch_norm": _BN_STATS,
    "aten::miopen_batch_norm": _BN_STATS,
}
_INFO: dict[Any, _Info] = {}


def written_arguments(func: Any) -> Writes:
    """The `(position, name)` of every argument the aten overload `func` writes to, declared or not."""
    schema = func._schema
    undeclared = _UNDECLARED.get(schema.name, ())
    return tuple(
        (position, argument.name)
        for position, argument in enumerate(schema.arguments)
        if (argument.alias_info is not None and argument.alias_info.is_write) or argument.name in undeclared
    )


def _info(func: Any) -> _Info:
    """Which arguments `func` writes to, and whether its outputs are new memory (not aliases)."""
    writes = written_arguments(func)
    fresh = all(result.alias_info is None for result in func._schema.returns)
    _INFO[func] = found = (writes, fresh)
    return found


def _memory(tensor: torch.Tensor) -> int:
    base = tensor._base
    return int((tensor if base is None else base).data_ptr())


class OutsideWrites(Mode):
    """Redirect in-place writes to tensors from outside the recompute onto clones."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()

    def _outside(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and _memory(value) not in self.made

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        writes, fresh = _INFO.get(func) or _info(func)
        if kwargs is None:
            kwargs = {}
        if writes:
            args = list(args)
            for position, name in writes:
                if position < len(args) and self._outside(args[position]):
                    args[position] = args[position].clone()
                elif name in kwargs and self._outside(kwargs[name]):
                    kwargs = {**kwargs, name: kwargs[name].clone()}
        out = func(*args, **kwargs)
        if fresh:
            made = self.made
            if type(out) is torch.Tensor:
                made.add(out.data_ptr())
            elif isinstance(out, (tuple, list)):
                for tensor in out:
                    if isinstance(tensor, torch.Tensor):
                        made.add(_memory(tensor))
        return out
