"""Policies for selective rematerialization: `save_nothing`, `save_all`, `save_matmuls`, `save_tagged`, `offload`.

>>> import remat
>>> remat.policies.save_matmuls | remat.policies.save_tagged("attn")
matmuls | save_tagged('attn',)
"""

from ._core.policies import Policy as Policy
from ._core.policies import offload as offload
from ._core.policies import save_all as save_all
from ._core.policies import save_matmuls as save_matmuls
from ._core.policies import save_nothing as save_nothing
from ._core.policies import save_tagged as save_tagged

__all__ = ["Policy", "offload", "save_all", "save_matmuls", "save_nothing", "save_tagged"]
