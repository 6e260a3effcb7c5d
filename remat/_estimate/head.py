"""The chunked head as a configuration of `remat.estimate` ("full+head", "save_matmuls+head"): see NOTE [ The head
as a choice ] in remat/_budget/head_choice.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from .._sites.head import route_head
from .predict import Configured

__all__ = ["HEAD", "split_head", "with_head"]

HEAD = "+head"
"""The suffix of a configuration whose step also computes the loss in chunks (`remat.apply(model, head=True)`)."""


def split_head(config: Any) -> tuple[Any, bool]:
    """`(the configuration without the suffix, whether it had it)`: "full+head" -> ("full", True)."""
    if isinstance(config, str) and config.endswith(HEAD):
        return config[: -len(HEAD)], True
    return config, False


def with_head(model: nn.Module, base: Configured, config: str) -> Configured:
    """`base` with the model's head routed for the step (checked now: a ValueError naming what was looked for)."""
    from .._sites.integrations.causal_lm import check

    check(model)

    @contextlib.contextmanager
    def applied(sample: Any) -> Iterator[None]:
        with base.apply(sample):  # it puts back the model's hooks and attributes, the head's among them
            route_head(model)
            yield

    return Configured(config, config, applied)

