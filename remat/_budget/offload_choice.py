"""Offload as a choice of a budget's plan (`remat.apply(model, budget=... | memory=...)`): whether the driver may put
what the rematerialized blocks keep on the host, doing so, and taking it back (NOTE [ Offload as a choice ]). The
driver (driver.py) takes the step; this module answers it, as head_choice.py and tiles_choice.py answer theirs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._core.options import Offloader
from .._engine.offload import Offload, resolve
from .._measure.fake import counted_on
from .._measure.host_offload import HostOffload
from .choices import Choices

__all__ = ["OffloadChoice", "offload_lowers_peak"]

# NOTE [ Offload as a choice ]
# With full remat of every block, the inputs the blocks keep grow with the layers and the sequence; per-block offload
# (`remat.apply(model, offload=True)`, NOTE [ Offload lifecycle ] in remat/_engine/transfer.py) keeps them in host
# memory and brings each back one block ahead of its backward, so that the device holds two of them, not all. A
# budget may need that where the head in chunks and tiles are not enough.
#
# Rules:
# 1. With `offload=None` (apply's default) a budget or memory plan offloads only where no choice per block is
#    predicted to fit with the head and the tiles as far as the plan may take them (NOTE [ The head as a choice ],
#    NOTE [ Tiles as a choice ]): those first, since they move nothing between host and device. It then puts what
#    every rematerialized choice keeps on the host and plans again, profile, costs and solve, for the same bytes.
#    Where a plan predicted to fit without it is refused by its real steps, the head, the tiles and then offload are
#    taken the same way.
# 2. Its bytes are measured, not predicted: the profile derives full remat and `save_matmuls` from each block's run
#    kept (NOTE [ Deriving choices ] in costs_derived.py), which offload does not change, so the prediction with
#    offload is the one without it, an upper bound (offload only takes bytes off the device). The plan is then
#    predicted not to fit and is verified on a real step before `remat.apply` returns (NOTE [ Verifying the plan ]
#    in verify.py, rule 4), which measures what the copies leave on the device. `memory=` prices it beforehand:
#    its least estimate (NOTE [ Total memory ] in remat/_apply/memory.py) runs "+offload" through `HostOffload`
#    (NOTE [ Offload on fake tensors ] in remat/_measure/host_offload.py), within bytes of the real step, and so does
#    an estimate's budget row, whose verifying step runs on fake tensors.
# 3. Only on an accelerator and in eager code: on the CPU host memory is the device's, offload is a pass-through
#    (NOTE [ What crosses ], rule 1, in remat/_engine/transfer.py), and inside one compiled graph
#    (`compile=True`) nothing is offloaded (NOTE [ Under torch.compile ] in remat/_engine/compiled.py): there the
#    choice is closed.
# 4. `offload=True` (or a `remat.offload(...)`) offloads what every rematerialized choice keeps before planning,
#    whatever the budget; `offload=False` never offloads. A kept block keeps its activations on the device either
#    way: offload is an option of remat's sites.
# 5. Offload the budget chose shows in `remat.plan(model)` on every block it rematerializes ("full + offload"), and
#    every re-plan (a new input shape) chooses again: first without it. A plan that fails takes it back, and a
#    re-plan that fails puts back what the plan before it offloaded with.
# 6. Only where it is needed: offload moves the kept bytes to the host and back on every step, and a plan that fits
#    without it spends no host memory or bandwidth.


def offload_lowers_peak(devices: Sequence[torch.device], compiled: bool) -> bool:
    """Whether offload takes bytes off the device a step runs on (rule 3): an accelerator (a CPU tensor standing in
    for one counts as it), in eager code."""
    return not compiled and any(counted_on(device).type not in ("cpu", "meta") for device in devices)


class OffloadChoice:
    """Offload's choice for one plan of `choices`' blocks on `devices` (NOTE [ Offload as a choice ]).

    `open` says whether the plan may still offload: apply's `offload` is None, the model is on an accelerator and
    its steps are not one compiled graph (rule 3). Made at the start of a plan, it puts the request's offload on the
    choices, taking back what an earlier plan chose (rule 5).
    """

    profiled = False  # rule 2

    def __init__(self, choices: Choices, devices: Sequence[torch.device], offload: bool | Offloader | None,
                 fake: bool = False, compiled: bool = False) -> None:
        self.choices = choices
        self.open = offload is None and offload_lowers_peak(devices, compiled)
        self.taken = False
        self.fake = fake  # the model's state is fake tensors (an estimate's budget row): offload is `HostOffload`
        self.earlier = choices.offload  # what the plan before this one offloaded with (rule 5)
        self.choices.offload = self._offload(offload)  # rule 4; rule 5: a re-plan chooses again

    def take(self) -> bool:
        """Offload what every rematerialized choice keeps (rule 1); True: it changes every such choice. Closes the
        choice: a plan offloads once."""
        self.open = False
        self.taken = True
        self.choices.offload = self._offload(True)
        return True

    def take_back(self) -> None:
        """Keep on the device again what this plan offloaded."""
        if self.taken:
            self.choices.offload = None
            self.taken = False

    def end(self, made: bool) -> None:
        """The plan is made (`made`), or it failed: what the plan before it offloaded with comes back (rule 5)."""
        if not made:
            self.taken = False
            self.choices.offload = self.earlier

    def _offload(self, offload: bool | Offloader | None) -> Offload | None:
        """What puts the kept tensors on the host: remat's offload, or on fake tensors its model (rule 2)."""
        found = resolve(offload)
        return HostOffload() if found is not None and self.fake else found
