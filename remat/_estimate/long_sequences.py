"""The configurations that matter at long sequences, for `remat.estimate`: full remat with the chunked head, tiles and
per-block offload, written as suffixes ("full+head", "full+head+tiles", "full+head+tiles+offload").

See NOTE [ Long-sequence configurations ].
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from .._core.requests import TILES, Where
from .._sites import targets as _targets
from .._sites.head import route_head
from .._sites.tiles import tile_blocks, untile
from .predict import Configured

__all__ = ["EXTRAS", "HEAD", "OFFLOAD", "TILES", "TILES_SUFFIX", "split_extras", "with_extras"]

# NOTE [ Long-sequence configurations ]
# At long sequences full remat leaves three terms that grow with the sequence: the blocks' inputs it keeps, one
# block's internals while its backward runs, and the head. Each has a remedy that `remat.estimate` can price:
#
# Rules:
# 1. A configuration is a base ("full" or "save_matmuls") and suffixes, each at most once, in any order: "+head"
#    (the loss in chunks, as `remat.apply(model, head=True)`), "+tiles" or "+tiles=N" (the token-wise modules of the
#    blocks in N tiles, `TILES` by default: `remat.tiled`, NOTE [ What is tiled ]), "+offload" (per-block offload,
#    `remat.apply(model, offload=True)`: what each block keeps goes to host memory).
# 2. Per-block offload lowers the device's peak only on an accelerator: on the CPU, offload is a pass-through, and
#    so is its estimate.
# 3. The step runs on fake tensors, where remat's own offload (which copies real memory on side streams) does
#    nothing; so the estimate offloads through `HostOffload` (NOTE [ Offload on fake tensors ] in
#    remat/_measure/host_offload.py), as a budget's profile does.

HEAD = "+head"
"""The suffix of a configuration whose step also computes the loss in chunks (`remat.apply(model, head=True)`)."""


TILES_SUFFIX = "+tiles"
"""The suffix of a configuration whose blocks' token-wise modules run in `TILES` tiles."""

OFFLOAD = "+offload"
"""The suffix of a configuration whose blocks keep what they keep on the host (`remat.apply(model, offload=True)`)."""

EXTRAS = ("head", "tiles", "offload")
"""The suffixes of rule 1."""


def split_extras(config: Any) -> tuple[Any, dict[str, int]]:
    """`(base, {suffix: value})` of a configuration (rule 1); the suffixes empty where it has none.

    >>> split_extras("full+head+tiles=4")
    ('full', {'head': 1, 'tiles': 4})
    >>> split_extras(0.3)
    (0.3, {})
    """
    if not isinstance(config, str) or "+" not in config:
        return config, {}
    base, *parts = config.split("+")
    extras: dict[str, int] = {}
    for part in parts:
        name, _, value = part.partition("=")
        if name not in EXTRAS or name in extras or (value and (name != "tiles" or not value.isdigit()
                                                                or int(value) < 1)):
            raise ValueError(
                f"remat: estimate does not know the configuration {config!r}: a base ('full', 'save_matmuls') and "
                "suffixes, each at most once: '+head' (the loss in chunks), '+tiles' or '+tiles=N' (the blocks' "
                "token-wise modules in tiles), '+offload' (what each block keeps on the host)."
            )
        extras[name] = int(value) if value else (TILES if name == "tiles" else 1)
    return base, extras


def with_extras(model: nn.Module, base: Configured, config: str, extras: dict[str, int],
                where: Where | None) -> Configured:
    """`base` (the base's sites, with `HostOffload` where "+offload" asks) with the head routed and the blocks'
    token-wise modules tiled for the step; checked now (a ValueError naming what was looked for)."""
    if "head" in extras:
        from .._sites.integrations.causal_lm import check

        check(model)
    blocks = _targets.select(model, where)  # no blocks: raised now

    @contextlib.contextmanager
    def applied(sample: Any) -> Iterator[None]:
        with base.apply(sample):  # it puts back the model's hooks and attributes, the head's among them
            if "head" in extras:
                route_head(model)
            tiled: list[str] = []
            if "tiles" in extras:
                tiled = list(tile_blocks(blocks, extras["tiles"]).tiled)
            try:
                yield
            finally:
                for name in tiled:
                    untile(model.get_submodule(name))

    return Configured(config, config, applied)
