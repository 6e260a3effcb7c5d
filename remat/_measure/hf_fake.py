"""Make transformers build the same attention masks on fake tensors as on real ones, while an estimate runs.

NOTE [ transformers and fake tensors ]
1. While an estimate runs, transformers' question whether position ids describe packed sequences
   (``find_packed_sequence_indices``) answers "not packed" for fake tensors, as it does for the usual batch; the
   sample's own ``position_ids``, when it has them, leave the question alone (a packed batch keeps its mask).
2. While an estimate runs, transformers' questions whether a mask may be skipped, the causal one
   (``_ignore_causal_mask_sdpa``: no padding, as long as the keys) and the bidirectional one
   (``_ignore_bidirectional_mask_sdpa``: an encoder's, eager attention's too), are asked of a fake padding mask as
   of none, where the sample's own ``attention_mask`` has no padding (every entry nonzero) or the sample has none: a
   real step then makes no mask (SDPA's ``is_causal`` does the causal one). A sample whose mask pads, or that the
   estimate cannot read (fake, meta, or among several positional tensors), leaves the questions alone: the mask is
   made, as a real step with padding makes it.
3. Each replacement of a module attribute is made by the first of overlapping estimates (in any threads) and put
   back by the last; one thread's estimate never changes the answer in another thread.
4. Nothing is done when transformers is not imported.

Implementation notes:
1. (rules 1, 2) transformers treats a `FakeTensor` as tracing (``is_tracing``) and then cannot read it: it assumes
   packing, or padding, and builds a full ``(batch, 1, seq, seq)`` mask, which also turns off SDPA's fused paths
   (and its grouped-query path: keys and values expanded to every head). An estimate would count bytes a real step
   never holds, a term that grows with the sequence's square (BioGPT's forward makes an all-ones mask itself).
2. (rule 3) A count under a lock; each thread asks the question its own way (a thread-local depth).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .._core.torch_compat import FakeTensor
from .sample import as_call

__all__ = ["real_masks", "real_masks_of"]

_PACKED = "find_packed_sequence_indices"
_CAUSAL_SKIP = "_ignore_causal_mask_sdpa"
_BIDIRECTIONAL_SKIP = "_ignore_bidirectional_mask_sdpa"


class _Patch:
    """One replacement of a function of transformers' masking_utils, shared by every estimate in the process: inside
    an estimate in this thread, a fake ``argument`` (the first) gets ``fake``'s answer (given the original and the
    call's arguments), any other the original's."""

    def __init__(self, name: str, argument: str, fake: Callable[..., Any]) -> None:
        self.name, self.argument = name, argument
        self._fake = fake
        self._lock = threading.Lock()
        self._users = 0
        self._module: Any = None
        self._original: Callable[..., Any] | None = None
        self._here = threading.local()  # how many estimates this thread is inside

    def _depth(self) -> int:
        return int(getattr(self._here, "depth", 0))

    def _replacement(self, *args: Any, **kwargs: Any) -> Any:
        original = self._original
        assert original is not None
        first = args[0] if args else kwargs.get(self.argument)
        if self._depth() > 0 and isinstance(first, FakeTensor):
            return self._fake(original, *args, **kwargs)
        return original(*args, **kwargs)

    @contextlib.contextmanager
    def active(self, masking: Any) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._module, self._original = masking, getattr(masking, self.name)
                setattr(masking, self.name, self._replacement)
            self._users += 1
        self._here.depth = self._depth() + 1
        try:
            yield
        finally:
            self._here.depth = self._depth() - 1
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    if getattr(self._module, self.name, None) == self._replacement:  # else replaced since
                        setattr(self._module, self.name, self._original)
                    self._module = self._original = None


def _without_padding(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """transformers' question whether a mask may be skipped, asked as of no padding mask (rule 2)."""
    if args:
        return original(None, *args[1:], **kwargs)
    return original(**{**kwargs, "padding_mask": None})


_PACKED_PATCH = _Patch(_PACKED, "position_ids", lambda original, *args, **kwargs: None)  # rule 1
_SKIP_PATCHES = tuple(_Patch(name, "padding_mask", _without_padding) for name in (_CAUSAL_SKIP, _BIDIRECTIONAL_SKIP))
"""Rule 2: the causal mask's question, and the bidirectional mask's (an encoder's, BERT's as a decoder)."""


def _unpadded(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether a real step on ``args`` and ``kwargs`` has no padding: its ``attention_mask`` every entry nonzero, or
    no mask at all (rule 2); False where it cannot be told (several positional tensors, a fake or meta mask)."""
    if "attention_mask" in kwargs:
        mask = kwargs["attention_mask"]
    elif sum(isinstance(arg, torch.Tensor) for arg in args) > 1:
        return False  # which one is the mask cannot be told
    else:
        return True
    if mask is None:
        return True
    if not isinstance(mask, torch.Tensor) or isinstance(mask, FakeTensor) or mask.is_meta:
        return False
    try:
        return bool(mask.all())
    except RuntimeError:  # no values to read here (a fake mode already in force)
        return False


def real_masks(sample: Any) -> contextlib.AbstractContextManager[None]:
    """While inside, transformers treats fake position ids as one sequence per row, and a fake padding mask as no
    padding where ``sample`` (as `remat.estimate` takes it) has none (see the NOTE above). Call it before a fake
    mode is entered: it reads the sample's mask."""
    return real_masks_of(*as_call(sample))


def real_masks_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> contextlib.AbstractContextManager[None]:
    """`real_masks` for a call's positional and keyword arguments."""
    return _patched("position_ids" not in kwargs, _unpadded(args, kwargs))


@contextlib.contextmanager
def _patched(unpacked: bool, unpadded: bool) -> Iterator[None]:
    masking = sys.modules.get("transformers.masking_utils")
    with contextlib.ExitStack() as patched:
        if unpacked and getattr(masking, _PACKED, None) is not None:
            patched.enter_context(_PACKED_PATCH.active(masking))
        for patch in _SKIP_PATCHES if unpadded else ():
            if getattr(masking, patch.name, None) is not None:
                patched.enter_context(patch.active(masking))
        yield
