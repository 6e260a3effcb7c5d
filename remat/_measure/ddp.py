"""DDP's gradient buckets in a per-rank estimate: `remat.estimate(model, sample, shard="ddp")`.

NOTE [ Estimating one rank of DDP ]
``DistributedDataParallel`` keeps every parameter, gradient and optimizer state whole on every rank; what it
adds is its reducer's gradient buckets.

Rules:
1. The buckets are flat tensors that together hold exactly the trainable parameters' elements, grouped by dtype
   and device, without padding, and live as long as the model: the bucket boundaries change no byte count, only
   the total does.
2. With ``gradient_as_bucket_view=False`` (the default) the gradients are tensors of their own, as without DDP,
   and the buckets are that much more memory. With ``gradient_as_bucket_view=True`` gradients take no bytes
   beyond the buckets but for the one being copied.
3. The estimate runs the plain step (parameters unsharded; no process group is needed, so it runs in one process,
   before or after ``init_process_group``) with fake buckets alive throughout.

Implementation notes:
1. (rule 1) One bucket per ``bucket_cap_mb`` (``bucket_cap_mb=25`` by default, the first one
   ``dist._DEFAULT_FIRST_BUCKET_BYTES``). They are allocated when DDP is constructed (and again, same sizes, when
   it rebuilds them in the second step's forward, freeing the old ones).
2. (rule 2) In backward, each gradient is copied into its bucket, the bucket all-reduced in place, and the result
   copied back. With ``gradient_as_bucket_view=True`` the reducer makes each gradient a view into its bucket once
   it has been copied there, and the gradient autograd made is freed.
3. (rule 3) In the view case a hook after each gradient's accumulation does what the reducer does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Buckets", "unwrap"]


def unwrap(model: nn.Module) -> tuple[nn.Module, bool] | None:
    """``(wrapped module, gradient_as_bucket_view)`` if ``model`` is a `DistributedDataParallel`, else None."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch without distributed
        return None
    if not isinstance(model, DistributedDataParallel):
        return None
    return model.module, bool(getattr(model, "gradient_as_bucket_view", False))


@dataclass
class Buckets:
    """The reducer's buckets for one estimate: made inside the fake mode by `make`, dropped by `close`."""

    views: bool
    flats: list[torch.Tensor] = field(default_factory=list)
    _handles: list[Any] = field(default_factory=list)

    def make(self, params: Sequence[torch.Tensor]) -> None:
        """One flat tensor per dtype and device over the dense trainable ``params`` (each counted once)."""
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        seen: set[int] = set()
        for p in params:
            if p.requires_grad and not p.is_sparse and id(p) not in seen:
                seen.add(id(p))
                groups.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, device), members in groups.items():
            flat = torch.empty(sum(p.numel() for p in members), dtype=dtype, device=device)
            self.flats.append(flat)
            if self.views:
                offset = 0
                for p in members:
                    view = flat[offset:offset + p.numel()].view(p.shape)
                    offset += p.numel()
                    self._handles.append(p.register_post_accumulate_grad_hook(_into(view)))  # type: ignore[no-untyped-call]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.flats.clear()


def _into(view: torch.Tensor) -> Any:
    """The reducer's step for one gradient with ``gradient_as_bucket_view=True``: copy in, then be the view."""

    def hook(p: torch.Tensor) -> None:
        grad = p.grad
        if grad is not None and grad.untyped_storage()._cdata != view.untyped_storage()._cdata:
            view.copy_(grad)
            p.grad = view
        del grad

    return hook
