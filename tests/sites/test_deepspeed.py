"""Budgets under DeepSpeed ZeRO (NOTE [ Budgets under DeepSpeed ZeRO ] in remat/_sites/integrations/deepspeed.py):
2 gloo ranks on CPU under `torch.distributed.run`, each running tests/sites/deepspeed_ranks.py.

Every case trains a tiny Llama (fp32) for two steps under ZeRO-2 or ZeRO-3 (every parameter partitioned), directly
on the engine or through the Hugging Face Trainer (the model built inside `zero.Init` under ZeRO-3), with
`remat.apply(model, budget=...)` before or after `deepspeed.initialize` (or `memory=`), LoRA or full fine-tuning,
and a shorter second step where the engine runs it; each is compared with the same training without remat. All
cases run in one launch, so deepspeed and transformers are imported once per rank.

DeepSpeed builds a small communication op with the system compiler the first time a process group starts: set
`TORCH_EXTENSIONS_DIR` to a folder that is kept (.ci/run does) to build it once.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import free_port

for _package, _extra in (("deepspeed", "deepspeed"), ("transformers", "hf"), ("peft", "hf")):
    # looked up, not imported: the ranks import them, this process need not
    if importlib.util.find_spec(_package) is None:
        pytest.skip(f"{_package} is not installed (the `{_extra}` extra)", allow_module_level=True)

import deepspeed_ranks as ranks  # noqa: E402  (this folder is on sys.path, as for conftest)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
DEADLINE_S = 600
SLACK = 1.05


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Every case and every reference, each rank's result: a dict, or the rank's traceback."""
    out = tmp_path_factory.mktemp("deepspeed")
    names = [*ranks.CASES, *dict.fromkeys(ranks.reference_name(name) for name in ranks.CASES)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
               "--master-port", str(free_port()), str(Path(ranks.__file__)), str(out), *names]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return {name: [torch.load(out / f"{name}.rank{rank}.pt", weights_only=False) for rank in range(WORLD)]
            for name in names}


def _results(runs: dict[str, list[Any]], name: str) -> list[dict[str, Any]]:
    found = runs[name]
    for result in found:
        if isinstance(result, str):
            pytest.fail(result, pytrace=False)
    return found


@pytest.mark.equivalence
@pytest.mark.parametrize("name", list(ranks.CASES))
def test_trains_as_without_checkpointing_within_budget(name: str, runs: dict[str, list[Any]]) -> None:
    """Losses and parameters after two steps equal no checkpointing's; remat recomputed; every rank ran the same
    plan; every step's measured activations and gradients stay within the budget (x1.05), the engine's own
    buffers set apart and said so once; no layer was moved to full remat by a correction."""
    results = _results(runs, name)
    references = _results(runs, ranks.reference_name(name))
    for rank, (got, expected) in enumerate(zip(results, references, strict=True)):
        assert got["losses"] == pytest.approx(expected["losses"], rel=1e-6, abs=1e-6), f"rank {rank}"
        assert got["params"].keys() == expected["params"].keys()
        for param, value in expected["params"].items():
            torch.testing.assert_close(got["params"][param], value, msg=lambda m, r=rank, n=param: f"{r} {n}: {m}")
        assert all(count > 0 for count in got["recomputes"]), f"rank {rank}: remat recomputed {got['recomputes']}"
        assert len([line for line in got["log"] if "set apart" in line]) == 1, got["log"]
    plans = [[plan["choice"] for plan in result["plans"]] for result in results]
    assert all(p == plans[0] for p in plans), f"the ranks ran different plans: {plans}"
    if not ranks.CASES[name].replan:  # the first plan, kept through the engine and the new shape
        assert all(plan == plans[0][0] for plan in plans[0]), plans[0]
        assert len({plan["budget"] for plan in results[0]["plans"]}) == 1, results[0]["plans"]
    for result in results:
        for step, plan in enumerate(result["plans"]):
            assert plan["measured"] is not None, f"step {step} was not measured"
            assert plan["measured"] <= SLACK * plan["budget"], f"step {step}: {plan}"
            assert plan["peak"] <= plan["budget"], f"step {step}: the prediction does not fit: {plan}"


REPLANNED = [name for name, case in ranks.CASES.items() if len(set(case.seqs)) > 1 and case.replan]


@pytest.mark.parametrize("name", REPLANNED)
def test_new_shape_plans_again_on_fake_tensors(name: str, runs: dict[str, list[Any]]) -> None:
    """A shorter second step plans again, on the engine's fake twin (no real step the engine sees: the gradients
    are the reference's, in the test above), for what a rank's step under the engine holds: each plan's prediction
    is within 5% of its step's measured peak, the engine's buffers set apart and its gradients taken as made."""
    case = ranks.CASES[name]
    for result in _results(runs, name):
        first, second = result["plans"]
        assert any("new input shapes" in line for line in result["log"]), result["log"]
        if case.memory is None:
            assert second["budget"] < first["budget"], (first, second)  # 0.5 of the shorter step's peak
        for plan in (first, second):
            assert plan["measured"] == pytest.approx(plan["peak"], rel=0.05), plan


@pytest.mark.parametrize("name", [name for name, case in ranks.CASES.items() if case.path == "trainer"])
def test_trainer_keyword_plans_nothing_again(name: str, runs: dict[str, list[Any]]) -> None:
    """The Trainer calls the model with `num_items_in_batch`, which the sample lacked: no new plan for it, so the
    plan made on the sample (or, under ZeRO-2, on the first forward the engine runs) is the one checked."""
    for result in _results(runs, name):
        assert not any("new input shapes" in line for line in result["log"]), result["log"]
        first, second = result["plans"]
        assert first["choice"] == second["choice"]


ENGINE_REFERENCES = sorted({ranks.reference_name(name) for name, case in ranks.CASES.items() if case.path == "engine"})


@pytest.mark.parametrize("name", ENGINE_REFERENCES)
def test_estimate_is_one_ranks_step(name: str, runs: dict[str, list[Any]]) -> None:
    """`remat.estimate` on the engine's model predicts one rank's steady step within 5% of its tracked peak (the
    rank's parameters, gradient partitions, optimizer state and the engine's buckets included): NOTE [ One rank's
    state under DeepSpeed ZeRO ]."""
    for result in _results(runs, name):
        assert result["engine_bytes"] > 0, result["engine_bytes"]
        assert result["estimated"] == pytest.approx(result["tracked"], rel=0.05), (result["estimated"],
                                                                                   result["tracked"])
