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
module attribute is put back on exit. Nothing is done when transformers is not imported.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .._core.torch_compat import FakeTensor

__all__ = ["real_masks"]


@contextlib.contextmanager
def real_masks(sample: Any) -> Iterator[None]:
    """While inside, transformers treats fake position ids as one sequence per row (see the NOTE above)."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if masking is None or original is None or (isinstance(sample, Mapping) and "position_ids" in sample):
        yield
        return

    def unpacked(position_ids: torch.Tensor) -> Any:
        if isinstance(position_ids, FakeTensor):
            return None
        return original(position_ids)

    setattr(masking, "find_packed_sequence_indices", unpacked)  # noqa: B010
    try:
        yield
    finally:
        setattr(masking, "find_packed_sequence_indices", original)  # noqa: B010
