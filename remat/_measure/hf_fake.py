"""Make transformers build the same attention masks on fake tensors as on real ones, while an estimate runs.

NOTE [ transformers and fake tensors ]
transformers treats a `FakeTensor` as a sign of tracing (``is_tracing``), and while tracing it must not read
tensor values. Its mask builder asks whether the position ids describe several sequences packed in one row
(``find_packed_sequence_indices``); on a real batch of one sequence per row the answer is "no" and attention
runs with ``is_causal`` and no mask, but on fake tensors it cannot read the ids, assumes packing, and builds a
full ``(batch, 1, seq, seq)`` mask, which also turns off SDPA's grouped-query path so that keys and values are
expanded to every head. An estimate would then count bytes a real step never holds. While an estimate runs,
`real_masks` makes that one question answer "not packed" for fake tensors, as it does for the usual batch; the
sample's own ``position_ids``, when it has them, leave the question alone (a packed batch keeps its mask). The
module attribute is put back when the last estimate ends. Nothing is done when transformers is not imported.

Estimates may run in several threads at once and end in any order, so the attribute is replaced once, by the
first of them, and put back by the last (a count under a lock); each thread asks the question its own way (a
thread-local depth), so that one thread's estimate never changes the answer in another thread.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .._core.torch_compat import FakeTensor

__all__ = ["real_masks"]

_NAME = "find_packed_sequence_indices"


class _PackedPatch:
    """The one replacement of transformers' packed-sequence question, shared by every estimate in the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._module: Any = None
        self._original: Callable[[torch.Tensor], Any] | None = None
        self._here = threading.local()  # how many estimates this thread is inside

    def _depth(self) -> int:
        return int(getattr(self._here, "depth", 0))

    def _unpacked(self, position_ids: torch.Tensor) -> Any:
        original = self._original
        assert original is not None
        if self._depth() > 0 and isinstance(position_ids, FakeTensor):
            return None
        return original(position_ids)

    @contextlib.contextmanager
    def active(self, masking: Any) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._module, self._original = masking, getattr(masking, _NAME)
                setattr(masking, _NAME, self._unpacked)
            self._users += 1
        self._here.depth = self._depth() + 1
        try:
            yield
        finally:
            self._here.depth = self._depth() - 1
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    if getattr(self._module, _NAME, None) == self._unpacked:  # else someone replaced it since
                        setattr(self._module, _NAME, self._original)
                    self._module = self._original = None


_PATCH = _PackedPatch()


@contextlib.contextmanager
def real_masks(sample: Any) -> Iterator[None]:
    """While inside, transformers treats fake position ids as one sequence per row (see the NOTE above)."""
    masking = sys.modules.get("transformers.masking_utils")
    if getattr(masking, _NAME, None) is None or (isinstance(sample, Mapping) and "position_ids" in sample):
        yield
        return
    with _PATCH.active(masking):
        yield
