"""A budget's profile on a fake twin of the model: planning allocates nothing the plan would not.

NOTE [ Planning on fake tensors ]
Rules:
1. `remat.apply(model, budget=B)` itself allocates no more than the larger of B and full remat's peak (with the
   check's `SLACK`) above what was live when it began, and `apply(memory=M)` keeps the process within M: a model
   that fits only with remat can be planned on the device it will train on.
2. So the profile (one training step with every block kept, which needs no remat's memory) runs on fake tensors:
   the model's parameters and buffers are swapped for fake ones for the duration, the sample is made fake, and
   the step is timed by priced time (NOTE [ Priced time ] in remat/_measure/clock.py). The user's tensors are
   never touched and nothing is allocated on the device. The plan goes on the real blocks; the first real
   training step is tracked as a safety net (NOTE [ The first step ]).
3. Where a fake step cannot stand in for the real one, the profile runs on the real model, as before, and needs
   the memory of a plain training step: a model planned for one compiled graph (its costs are shifted by real
   compiled runs), a model sharded by `fully_shard` or wrapped in DDP (their collectives need real tensors), the
   replay strategy (its tape runs its recorded ops on the tensors it kept, which a fake profile mixes with real
   ones), a model that is fake, on meta or made of DTensors already (`remat.estimate`), and a step with a
   data-dependent op (`.item()`, `nonzero`), which fake tensors cannot run: that one is logged.

Implementation notes:
1. The fake twin is `fake_state` (NOTE [ Swapping in fake state ] in remat/_measure/fake.py); hooks and module
   attributes stay, so the blocks' choices are placed on the user's own modules while the profile runs and stay
   there after it.
2. The fake sample keeps one fake per tensor object (an `input_ids` that is also `labels` stays one tensor), and
   transformers' packed-sequence detection is kept off fake position ids (`real_masks`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from .._core.torch_compat import FakeTensor, local_tensor
from .._measure import ddp as _ddp
from .._measure.fake import data_dependent, fake_mode, fake_sample, fake_state, resolve_device
from .._measure.hf_fake import real_masks

__all__ = ["on_fake", "profile_fake"]

_T = TypeVar("_T")
_log = logging.getLogger("remat")


def on_fake(model: nn.Module, compile: bool, strategy: str) -> bool:
    """Whether a budget's profile of `model` runs on fake tensors (NOTE [ Planning on fake tensors ], rule 3)."""
    if compile or strategy != "rerun" or _ddp.unwrap(model) is not None:
        return False
    for t in (*model.parameters(), *model.buffers()):
        local = local_tensor(t)  # a DTensor (a sharded model) has a local shard that is another tensor
        if local is not t or isinstance(t, FakeTensor) or t.device.type == "meta":
            return False
    return True


def profile_fake(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    step_on: Callable[[tuple[Any, ...], dict[str, Any]], Callable[[], torch.Tensor]],
    profile: Callable[[Callable[[], torch.Tensor]], _T],
) -> _T | None:
    """`profile(step)` with `step` a training step of a fake twin of `model` on a fake copy of the inputs; None
    where the step reads tensor values, which fake tensors do not have (NOTE [ Planning on fake tensors ]).

    Args:
        model: the real model; its tensors are swapped for fake ones while `profile` runs and put back after.
        args, kwargs: the real inputs.
        step_on: makes the training step on given inputs.
        profile: profiles the step it is given.
    """
    device = resolve_device(model, (args, kwargs), None)
    try:
        with fake_mode(), fake_state(model, device), real_masks(kwargs), torch.enable_grad():
            fake_args, fake_kwargs = fake_sample((args, kwargs), device)
            return profile(step_on(tuple(fake_args), fake_kwargs))
    except Exception as error:
        if data_dependent(error, type(model).__name__) is None:
            raise
        _log.warning("remat: %s's step reads tensor values, which fake tensors lack (%s); its budget is profiled "
                     "on a real step, which needs the memory of a plain training step.", type(model).__name__,
                     type(error).__name__)
        return None
