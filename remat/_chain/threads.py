"""The solver's tensor work runs on one intra-op thread: see NOTE [ Solver threads ]."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["one_thread"]

# NOTE [ Solver threads ]
# The table is filled by a few thousand tensor operations of a few MB each. With torch's intra-op
# thread pool on a busy machine (more runnable threads than cores) each of them can wait a scheduler
# slice for a descheduled worker, and a solve on two threads ran several times slower than on one
# (docs/benchmarks.md). So the solver runs on one intra-op thread, restoring the
# previous count afterwards; a lock and a depth count keep concurrent solves from restoring out of
# order. Only tensor operations issued while a solve runs are affected, and only in speed.
_threads_lock = threading.Lock()
_threads_depth = 0
_threads_saved = 1


@contextmanager
def one_thread() -> Iterator[None]:
    global _threads_depth, _threads_saved
    with _threads_lock:
        if _threads_depth == 0:
            _threads_saved = torch.get_num_threads()
            if _threads_saved != 1:
                torch.set_num_threads(1)
        _threads_depth += 1
    try:
        yield
    finally:
        with _threads_lock:
            _threads_depth -= 1
            if _threads_depth == 0 and _threads_saved != 1:
                torch.set_num_threads(_threads_saved)
