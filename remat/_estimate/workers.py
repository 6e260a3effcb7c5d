"""An estimate's configurations in worker processes forked from this one (`remat.estimate(..., jobs=N)`).

See NOTE [ Configurations in workers ].
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

__all__ = ["can_fork", "in_workers"]

_T = TypeVar("_T")
_R = TypeVar("_R")

# NOTE [ Configurations in workers ]
# An estimate's configurations are independent: each runs its own steps on the fake model, which only reads the
# state they share (the fake parameters, the optimizer's state). Their steps are Python-bound (a fake op costs the
# same whether its tensor is a kilobyte or a gigabyte), so processes, not threads, run them side by side.
#
# Rules:
# 1. With `jobs` > 1, `jobs` workers are forked from this process once it holds the fake session, and take the
#    configurations one at a time, each the next one not taken, until none is left; this process collects their
#    rows. The report is the one `jobs=1` gives, row for row, in the order of `configs`.
# 2. They take those likely to take longest first (a budget, which plans anew, then those with more suffixes, each
#    a step's more work, then all but "none"), so that the last to finish is a short one.
# 3. A worker runs nothing but fake steps, on one thread, and leaves by `os._exit`: nothing of this process (its
#    files, its atexit handlers, a test runner's state) runs twice.
# 4. Where a worker fails (an error in a configuration, a row that cannot be pickled, a worker killed), the
#    configurations it did not answer run here after the others, so their errors are raised here, as with `jobs=1`.
# 5. Only where the platform forks safely (Linux), and for one process's whole model (not a rank's under FSDP2,
#    DDP or DeepSpeed, whose fake process group and engine are this process's); elsewhere, and with `jobs=1`, the
#    configurations run here in turn.
#
# Implementation notes:
# 1. (rule 1) The configurations to take are bytes in one pipe that every worker reads one at a time (a read of
#    one byte from a pipe is atomic); each worker writes its rows into a pipe of its own, each behind its index and
#    length.
# 2. (rule 1) Each worker counts the optimizer's step on its first configuration, as the first row counts it
#    without workers (NOTE [ One optimizer step ] in predict.py): the same bytes, counted once per process.


def can_fork() -> bool:
    """Whether configurations may run in forked workers here (rule 5)."""
    return sys.platform == "linux" and hasattr(os, "fork")


def in_workers(items: Sequence[_T], work: Callable[[_T], _R], jobs: int,
               order: Sequence[int] | None = None) -> list[_R]:
    """`[work(item) for item in items]`, the items taken by `jobs` forked workers (NOTE [ Configurations in
    workers ]), taken in ``order`` (indices; default: as given); in this process alone where `jobs` is 1, the
    items are fewer than two or the platform does not fork."""
    jobs = min(jobs, len(items), 255)
    if jobs < 2 or not can_fork():
        return [work(item) for item in items]
    tasks_read, tasks_write = os.pipe()
    os.write(tasks_write, bytes(range(len(items)) if order is None else order))
    os.close(tasks_write)
    workers: list[tuple[int, int]] = []
    for _ in range(jobs):
        results_read, results_write = os.pipe()
        pid = os.fork()
        if pid == 0:  # rule 3
            code = 1
            try:
                os.close(results_read)
                _take_and_answer(items, work, tasks_read, results_write)
                code = 0
            finally:
                os._exit(code)
        os.close(results_write)
        workers.append((pid, results_read))
    os.close(tasks_read)
    done: dict[int, _R] = {}
    for pid, results_read in workers:
        done.update(_collect(results_read))
        os.waitpid(pid, 0)
    return [done[index] if index in done else work(item) for index, item in enumerate(items)]  # rule 4


def _take_and_answer(items: Sequence[_T], work: Callable[[_T], _R], tasks: int, results: int) -> None:
    """A worker's loop: take the next item, answer it, until none is left or one fails."""
    torch.set_num_threads(1)
    with os.fdopen(results, "wb") as out:
        while task := os.read(tasks, 1):
            index = task[0]
            answer = pickle.dumps(work(items[index]))
            out.write(struct.pack("<BQ", index, len(answer)) + answer)
            out.flush()


def _collect(results: int) -> dict[int, _R]:
    """The answers a worker wrote, until its pipe closes; what it left half-written is dropped."""
    header = struct.calcsize("<BQ")
    found: dict[int, _R] = {}
    with os.fdopen(results, "rb") as source:
        while len(head := source.read(header)) == header:
            index, size = struct.unpack("<BQ", head)
            body = source.read(size)
            if len(body) != size:
                break
            found[index] = pickle.loads(body)
    return found
