"""Make transformers build the same attention masks on fake tensors as on real ones, while an estimate runs.

NOTE [ transformers and fake tensors ]
1. While an estimate runs, transformers' question whether position ids describe packed sequences
   (``find_packed_sequence_indices``) answers "not packed" for fake tensors, as it does for the usual batch; the
   sample's own ``position_ids``, when it has them, leave the question alone (a packed batch keeps its mask).
2. The module attribute is replaced by the first of overlapping estimates (in any threads) and put back by the
   last; one thread's estimate never changes the answer in another thread.
3. Nothing is done when transformers is not imported.

Implementation notes:
1. (rule 1) transformers treats a `FakeTensor` as tracing (``is_tracing``) and then cannot read the ids: it assumes
   packing and builds a full ``(batch, 1, seq, seq)`` mask, which also turns off SDPA's grouped-query path (keys
   and values expanded to every head). An estimate would count bytes a real step never holds.
2. (rule 2) A count under a lock; each thread asks the question its own way (a thread-local depth).
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
