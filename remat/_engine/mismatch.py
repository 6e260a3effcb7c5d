"""The text of a `RecomputeMismatchError`: torch's words for the condition, then remat's site, detail and advice.

See NOTE [ Mismatch messages ].
"""

from __future__ import annotations

import torch

from .debug import side_by_side

__all__ = ["Meta", "mismatch_message"]

Meta = tuple[torch.Size, torch.dtype, torch.device]

# NOTE [ Mismatch messages ]
# 1. A recompute mismatch is also a `torch.utils.checkpoint.CheckpointError` (remat/_core/errors.py).
# 2. Its message opens with torch's own sentence for the same condition, kept verbatim from
#    torch/utils/checkpoint.py (users search for it), then says in remat's words where it happened (the site's name
#    and the saved tensor's index), what forward and recompute saved, and what to do.
_TORCH_MORE = (
    "torch.utils.checkpoint: trying to save more tensors during recomputation than during the original forward pass."
)
_TORCH_COUNT = (
    "torch.utils.checkpoint: A different number of tensors was saved during the original forward and recomputation."
)
_TORCH_METADATA = (
    "torch.utils.checkpoint: Recomputed values for the following tensors have different metadata than during the "
    "forward pass."
)
# Under debug traces torch replaces its message with a log of both runs that ends in these words; remat keeps its
# own shorter traces and says the same sentence above them.
_TORCH_DEBUG = (
    "torch.utils.checkpoint: Detected non-determinism while running activation checkpointing. You are seeing this "
    "error because you passed `debug=True` to checkpoint (or turned on remat's debug mode, REMAT_DEBUG=1), and the "
    "tensors saved during the original forward differ from those saved during recomputation."
)
_ADVICE = (
    "The function must run the same ops in backward as in forward: look for global state, Python side effects or "
    "data-dependent control flow, or use strategy='replay', which replays the recorded ops."
)


def _torch_words(index: int, expected: Meta | None, got: Meta | None) -> str:
    """torch's sentence (and, for metadata, its per-tensor lines) for the condition remat found."""
    if got is None:  # recompute stopped short (forward's tensor is unknown when checks are off)
        return _TORCH_COUNT
    if expected is None:
        return _TORCH_MORE
    return (
        f"{_TORCH_METADATA}\ntensor at position {index}:\nsaved metadata: {_as_torch(expected)}\n"
        f"recomputed metadata: {_as_torch(got)}"
    )


def _as_torch(meta: Meta) -> dict[str, object]:
    """A (shape, dtype, device) triple as torch's default determinism check prints it."""
    return {"shape": meta[0], "dtype": meta[1], "device": meta[2]}


def mismatch_message(
    site: str,
    index: int,
    what: str,
    expected: Meta | None,
    got: Meta | None,
    traces: tuple[list[str], list[str]] | None,
) -> str:
    """The text of a `RecomputeMismatchError`: where forward and recompute parted, why, and what to do.

    Args:
        site: the site's name.
        index: the saved tensor at which they parted.
        what: one clause saying what differed ("recompute saved more tensors than forward did").
        expected, got: (shape, dtype, device) of forward's and recompute's tensor there, None for none.
        traces: forward's and recompute's op traces under debug mode, or None.

    >>> print(mismatch_message("f", 2, "recompute saved fewer tensors than forward did", None, None, None)[:70])
    remat: torch.utils.checkpoint: A different number of tensors was saved
    """

    def describe(meta: Meta | None) -> str:
        return "no tensor" if meta is None else f"shape {tuple(meta[0])}, dtype {meta[1]}, device {meta[2]}"

    message = (
        f"remat: {_torch_words(index, expected, got)}\n"
        f"In `{site}`, {what}: at saved tensor #{index} forward saved {describe(expected)}, "
        f"recompute saved {describe(got)}. {_ADVICE}"
    )
    if traces is not None:
        message += f"\n{_TORCH_DEBUG}\nOp traces (REMAT_DEBUG=1):\n" + side_by_side(*traces)
    else:
        message += " Set REMAT_DEBUG=1 to see the op traces of forward and recompute side by side."
    return message
