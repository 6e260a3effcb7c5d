"""What a device allocates once, at the first step, and keeps: counted in the estimate's peaks.

NOTE [ A first step's constants ]
On CUDA the first matmul a thread runs on a device allocates the workspaces of its cuBLAS handle through the
caching allocator, and they stay allocated: `torch.cuda.max_memory_allocated` shows them in every step after. Two
threads run a training step's matmuls: the forward's, and autograd's device thread in backward, each with its own
handle. So the estimate's CUDA rows count, once for each of `THREADS` threads, the cuBLAS workspace (torch's
``CUBLAS_WORKSPACE_CONFIG`` if set, the sum of its ``:SIZE_KiB:COUNT`` entries; else torch's default for the
device's compute capability, larger from Hopper on) and the cuBLASLt workspace (``CUBLASLT_WORKSPACE_SIZE`` KiB,
else torch's default), as aten/src/ATen/cuda/CublasHandlePool.cpp sizes them. A step measured on an H200 read
exactly two of each above its tensors (docs/benchmarks.md, "Figures behind the design notes"). Without a GPU the
capability is unknown and taken as Hopper's (the larger workspace). What the estimate does not count: the CUDA
context itself (not in `max_memory_allocated`), and workspaces that other libraries allocate through the caching
allocator on a first call (cuDNN's convolution workspaces are per call, counted as tensors only where the op's
fake kernel makes them).
"""

from __future__ import annotations

import os
import re

import torch

__all__ = ["THREADS", "cublas_workspace", "first_step_bytes"]

THREADS = 2
"""Threads that run a step's matmuls on one device: the forward's and autograd's device thread (backward)."""

_MIB = 1 << 20


def cublas_workspace(capability: tuple[int, int] | None) -> int:
    """Bytes of one cuBLAS handle's workspaces (cuBLAS and cuBLASLt) on a device of that compute capability (None:
    unknown, taken as 9.0), as torch sizes them (NOTE [ A first step's constants ]).

    >>> cublas_workspace((9, 0)) == 33 * 2**20, cublas_workspace((8, 0)) == 9 * 2**20 + 128 * 1024
    (True, True)
    """
    major = 9 if capability is None else capability[0]
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    entries = re.findall(r":([0-9]+):([0-9]+)", config)
    if entries:
        cublas = sum(int(size) * 1024 * int(count) for size, count in entries)
    else:
        cublas = 32 * _MIB if major >= 9 else 8 * _MIB + 128 * 1024
    try:
        lt = int(os.environ.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * 1024
    except ValueError:
        lt = _MIB
    return cublas + lt


def first_step_bytes(device: torch.device) -> int:
    """Bytes a training step on ``device`` allocates once and keeps: on CUDA, the cuBLAS workspaces of the threads
    that run its matmuls (NOTE [ A first step's constants ]); elsewhere nothing.

    >>> first_step_bytes(torch.device("cpu"))
    0
    """
    if device.type != "cuda":
        return 0
    capability = None
    if torch.cuda.is_available() and device.index is not None and device.index < torch.cuda.device_count():
        capability = torch.cuda.get_device_capability(device)
    return THREADS * cublas_workspace(capability)
