"""`remat.estimate(..., jobs=N)`: the configurations in forked workers give the report of one process
(NOTE [ Configurations in workers ])."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat._estimate import predict as _predict
from remat._estimate.workers import can_fork, in_workers

pytestmark = pytest.mark.skipif(not can_fork(), reason="workers fork on Linux only")

WIDTH = 32


def stack(depth: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                         nn.Linear(4 * WIDTH, WIDTH)) for _ in range(depth)])


def loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _noting(monkeypatch: pytest.MonkeyPatch, path: Path, fail_in_workers: str | None = None) -> None:
    """Each configuration's row notes the process that ran it in `path`; with `fail_in_workers`, that
    configuration raises in any process but this one."""
    row, here = _predict._Steps.row, os.getpid()

    def noted(self: Any, configured: Any, given: Any, depth: int | None = None) -> Any:
        with path.open("a") as f:
            f.write(f"{configured.label} {os.getpid()}\n")
        if configured.label == fail_in_workers and os.getpid() != here:
            raise RuntimeError("a worker's failure")
        return row(self, configured, given, depth)

    monkeypatch.setattr(_predict._Steps, "row", noted)


def _ran(path: Path) -> dict[str, set[int]]:
    ran: dict[str, set[int]] = {}
    for line in path.read_text().splitlines():
        label, pid = line.rsplit(" ", 1)
        ran.setdefault(label, set()).add(int(pid))
    return ran


def test_the_workers_report_is_the_one_of_one_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    x = torch.randn(2, 64, WIDTH)
    configs = ("none", "full", "save_matmuls", "full+tiles=4", 0.5)
    kwargs: dict[str, Any] = {"loss": loss, "optimizer": "adamw", "configs": configs, "memory": "8MiB",
                              "batch_dim": 0, "seq_dim": 1}
    alone = remat.estimate(stack(), x, **kwargs)
    _noting(monkeypatch, tmp_path / "rows")
    side_by_side = remat.estimate(stack(), x, jobs=3, **kwargs)
    assert side_by_side.to_dict() == alone.to_dict()
    assert [row.largest_seq for row in side_by_side.rows] == [row.largest_seq for row in alone.rows]
    ran = _ran(tmp_path / "rows")
    assert os.getpid() not in set().union(*ran.values())  # every row ran in a worker
    assert len(set().union(*ran.values())) > 1 and all(len(pids) == 1 for pids in ran.values()), ran


def test_a_configuration_a_worker_fails_runs_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    x = torch.randn(2, 64, WIDTH)
    configs = ("none", "full", "save_matmuls")
    alone = remat.estimate(stack(), x, loss=loss, configs=configs)
    _noting(monkeypatch, tmp_path / "rows", fail_in_workers="full")
    side_by_side = remat.estimate(stack(), x, loss=loss, configs=configs, jobs=2)
    assert side_by_side.to_dict() == alone.to_dict()
    assert os.getpid() in _ran(tmp_path / "rows")["full"]


class _Selecting(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return h[h > 0]  # a shape that depends on the values


def test_an_error_in_the_workers_is_raised_here_as_without_them() -> None:
    for jobs in (1, 2):
        model = nn.Sequential(_Selecting(8, 8), _Selecting(8, 8))
        with pytest.raises(remat.RematError, match=r"^remat: estimate cannot run `Sequential`.*aten.nonzero"):
            remat.estimate(model, torch.randn(4, 8), configs=("none", "full"), jobs=jobs)


def test_in_workers_keeps_the_order_of_its_items() -> None:
    assert in_workers(list(range(7)), lambda n: n * n, jobs=3) == [n * n for n in range(7)]


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True, "2"])
def test_jobs_must_be_a_positive_count(jobs: Any) -> None:
    with pytest.raises(ValueError, match=r"remat: estimate's `jobs` must be a positive int"):
        remat.estimate(stack(), torch.randn(2, 8, WIDTH), loss=loss, configs=("none",), jobs=jobs)


def test_the_workers_take_the_longest_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """NOTE [ Configurations in workers ], rule 2: a budget, then more suffixes, then all but "none"; one worker
    takes them in that order."""
    _noting(monkeypatch, tmp_path / "rows")
    configs = ("none", "full", "full+tiles=2", 0.9)
    report = remat.estimate(stack(), torch.randn(2, 16, WIDTH), loss=loss, configs=configs, jobs=2)
    assert [row.label for row in report.rows] == ["none", "full", "full+tiles=2", "budget 0.9"]
    first = [line.split()[0] for line in (tmp_path / "rows").read_text().splitlines()]
    assert first[0] in ("budget", "full+tiles=2") and first[-1] == "none", first
