"""Tests of the rotor-style solver (`remat._chain.solver`): reference values, optimality, baselines."""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from math import comb

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat._chain.solver import (
    Schedule,
    StageCost,
    _InvalidOp,
    _Machine,
    _solve_dp,
    smallest_budget,
    solve,
)
from remat._core.errors import BudgetError

TOY = [StageCost(forward_time=1.0, backward_time=2.0, output_bytes=1, saved_bytes=2)] * 10


@st.composite
def chains(draw: st.DrawFn, max_stages: int = 5, max_bytes: int = 4) -> list[StageCost]:
    """Random heterogeneous chains with small integer sizes and integer-valued times."""
    n = draw(st.integers(1, max_stages))
    out = []
    for _ in range(n):
        x = draw(st.integers(0, max_bytes))
        out.append(
            StageCost(
                forward_time=float(draw(st.integers(0, 5))),
                backward_time=float(draw(st.integers(0, 5))),
                output_bytes=x,
                saved_bytes=x + draw(st.integers(0, max_bytes)),
                forward_temp=draw(st.integers(0, 2)),
                backward_temp=draw(st.integers(0, 2)),
            )
        )
    return out


def _exhaustive(stages: list[StageCost], budget: int, input_bytes: int) -> float | None:
    """The least makespan over every valid schedule whose operations all fit `budget`.

    Dijkstra over the simulator's states: from each state every operation the model allows is tried,
    so this covers schedules of any shape, not only those of the rotor recurrence.
    """
    n = len(stages)
    machine = _Machine(stages, input_bytes)
    start = machine.snapshot()
    ops = [(k, i) for i in range(n) for k in ("forward_nosave", "forward_checkpoint", "forward_save")]
    ops += [("backward", i) for i in range(n)] + [("loss", n)]
    dist = {start: 0.0}
    heap: list[tuple[float, int, tuple[object, ...]]] = [(0.0, 0, start)]
    counter = 1
    while heap:
        cost, _, snap = heapq.heappop(heap)
        if cost > dist[snap]:  # type: ignore[index]
            continue
        machine.restore(snap)  # type: ignore[arg-type]
        if machine.done:
            return cost
        for kind, i in ops:
            machine.restore(snap)  # type: ignore[arg-type]
            try:
                t, peak = machine.step(kind, i)
            except _InvalidOp:
                continue
            if peak > budget:
                continue
            new = machine.snapshot()
            if cost + t < dist.get(new, math.inf):
                dist[new] = cost + t
                heapq.heappush(heap, (cost + t, counter, new))
                counter += 1
    return None


def _revolve_extra_forwards(steps: int, snaps: int) -> int:
    """Griewank's binomial optimum: extra forwards = r*l - C(s+r, s+1), r least with C(s+r, s) >= l."""
    r = 0
    while comb(snaps + r, snaps) < steps:
        r += 1
    return r * steps - comb(snaps + r, snaps + 1)


@pytest.mark.parametrize(
    ("memory", "makespan"),
    [(6, 75), (8, 44), (10, 38), (12, 37), (14, 35), (16, 34), (18, 33), (20, 32), (22, 31), (24, 30)],
)
def test_toy_chain_matches_rotor_reference(memory: int, makespan: float) -> None:
    """rotor's toy chain (L=10, u_f=1, u_b=2, x=1, xbar=2) at rotor's memory M.

    Mapping: rotor's sizes are in memory slots and it solves C(M - x_0, 0, L), the chain input x_0
    counted inside M; our budget covers the chain input too. So rotor's M is our `budget` (bytes),
    with `input_bytes = x_0 = 1`, the loss stage's own output counting 0 bytes, and `slots=M` so that
    one slot is one byte, as in rotor's table. At the default 500 slots a slot is M/500 bytes and
    every size is rounded up to whole slots: exact when 500 is a multiple of M, never faster otherwise.
    """
    exact = solve(TOY, memory, input_bytes=1, slots=memory)
    assert exact.makespan == makespan
    assert exact.peak_bytes <= memory
    dp = _solve_dp(TOY, memory, 1, memory)
    assert dp is not None and dp[0] == makespan
    default = solve(TOY, memory, input_bytes=1)
    assert default.peak_bytes <= memory
    assert default.makespan >= makespan
    if 500 % memory == 0:
        assert default.makespan == makespan


def test_toy_chain_below_smallest_budget_raises_budget_error() -> None:
    assert smallest_budget(TOY, input_bytes=1) == 6
    for memory in (4, 5):
        with pytest.raises(BudgetError, match=r"^remat: .*smallest feasible budget is 6 bytes") as info:
            solve(TOY, memory, input_bytes=1)
        assert info.value.least_bytes == 6
    assert _solve_dp(TOY, 4, 1, 4) is None


def test_large_budget_equals_no_remat() -> None:
    rng = random.Random(0)
    stages = [StageCost(rng.uniform(1, 3), rng.uniform(2, 5), (x := rng.randint(10, 99)), x * 3) for _ in range(12)]
    base = Schedule.no_remat(stages, input_bytes=50)
    for budget in (base.peak_bytes, base.peak_bytes * 2, 10**12):
        plan = solve(stages, budget, input_bytes=50)
        assert plan.makespan == pytest.approx(base.makespan)
        assert plan.extra_forwards() == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(max_stages=12, max_bytes=40), st.integers(0, 40), st.lists(st.floats(0, 1.2), min_size=2))
def test_more_budget_is_never_slower(stages: list[StageCost], x0: int, fractions: list[float]) -> None:
    least = smallest_budget(stages, input_bytes=x0)
    top = Schedule.no_remat(stages, input_bytes=x0).peak_bytes
    budgets = sorted({max(least, int(least + f * (top - least))) for f in fractions})
    times = [solve(stages, b, input_bytes=x0, slots=60).makespan for b in budgets]
    assert all(t1 >= t2 for t1, t2 in itertools.pairwise(times))


@settings(max_examples=60, deadline=None)
@given(chains(max_stages=8, max_bytes=30), st.integers(0, 30), st.floats(0, 1.5), st.integers(1, 80))
def test_no_plan_exceeds_its_budget(stages: list[StageCost], x0: int, fraction: float, slots: int) -> None:
    least = smallest_budget(stages, input_bytes=x0)
    top = Schedule.no_remat(stages, input_bytes=x0).peak_bytes
    budget = max(1, int(least + fraction * (top - least)))
    plan = solve(stages, budget, input_bytes=x0, slots=slots)
    assert plan.peak_bytes <= budget
    # The plan is played again from its ops alone: the same prediction.
    again = Schedule.from_ops(stages, plan.ops, input_bytes=x0)
    assert (again.makespan, again.peak_bytes) == (plan.makespan, plan.peak_bytes)


@settings(max_examples=40, deadline=None)
@given(chains(max_stages=10, max_bytes=30), st.integers(0, 30), st.floats(0, 1.2))
def test_never_slower_than_recompute_all_or_segments(stages: list[StageCost], x0: int, fraction: float) -> None:
    least = smallest_budget(stages, input_bytes=x0)
    top = Schedule.no_remat(stages, input_bytes=x0).peak_bytes
    budget = max(1, int(least + fraction * (top - least)))
    plan = solve(stages, budget, input_bytes=x0)
    # The dynamic program alone, in exact bytes, must also beat them: it is not the fallback.
    dp = _solve_dp(stages, budget, x0, budget)
    baselines = [Schedule.recompute_all(stages, input_bytes=x0)]
    baselines += [Schedule.segments(stages, k, input_bytes=x0) for k in range(1, len(stages) + 1)]
    for base in baselines:
        if base.peak_bytes <= budget:
            assert plan.makespan <= base.makespan + 1e-9, base.name
            assert dp is not None and dp[0] <= base.makespan + 1e-9, base.name


@pytest.mark.slow  # an exhaustive search for seconds: NOTE [ Slow tests ] in tests/conftest.py
@settings(max_examples=150, deadline=None)
@given(chains(max_stages=5, max_bytes=3), st.integers(0, 3), st.integers(1, 30))
def test_optimum_agrees_with_exhaustive_search(stages: list[StageCost], x0: int, budget: int) -> None:
    best = _exhaustive(stages, budget, x0)
    dp = _solve_dp(stages, budget, x0, budget)
    if best is None:
        assert dp is None
        with pytest.raises((BudgetError, ValueError)):
            solve(stages, budget, input_bytes=x0)
        return
    assert dp is not None and dp[0] == best
    assert solve(stages, budget, input_bytes=x0, slots=budget).makespan == best
    assert smallest_budget(stages, input_bytes=x0) <= budget


@pytest.mark.parametrize(("steps", "snaps"), [(10, 3), (100, 4), (10, 1), (20, 3), (30, 5), (50, 3), (10, 10)])
def test_homogeneous_chain_matches_revolve(steps: int, snaps: int) -> None:
    """Where rotor's model and Revolve's coincide, the extra forwards are Griewank's binomial optimum.

    Every activation is 1 byte and xbar is so large (60) that two never fit at once, so the budget
    s + 1 (snapshots and the state being reversed) + 60 (xbar) + 2 (two gradients) leaves room for
    exactly `snaps` checkpoints, the chain input among them, as in Revolve.
    """
    stages = [StageCost(1.0, 0.0, output_bytes=1, saved_bytes=60)] * steps
    budget = snaps + 1 + 60 + 2
    plan = solve(stages, budget, input_bytes=1, slots=budget)
    assert plan.extra_forwards() == _revolve_extra_forwards(steps, snaps)
    assert plan.makespan == steps + _revolve_extra_forwards(steps, snaps)


def test_hundred_stages_five_hundred_slots_timing() -> None:
    rng = random.Random(1)
    stages = []
    for _ in range(100):
        x = rng.randint(1 << 20, 8 << 20)
        stages.append(
            StageCost(
                rng.uniform(1, 3),
                rng.uniform(2, 6),
                x,
                x + rng.randint(0, 24 << 20),
                rng.randint(0, 1 << 20),
                rng.randint(0, 1 << 20),
            )
        )
    base = Schedule.no_remat(stages, input_bytes=4 << 20)
    start = time.perf_counter()
    plan = solve(stages, base.peak_bytes // 3, input_bytes=4 << 20, slots=500)
    elapsed = time.perf_counter() - start
    print(
        f"\nsolve: 100 stages x 500 slots in {elapsed:.3f} s, makespan {plan.makespan:.1f} "
        f"(no remat {base.makespan:.1f})"
    )
    assert plan.peak_bytes <= base.peak_bytes // 3
    assert elapsed < 20  # a loose sanity bound; the aim is < 2 s


def test_schedule_renders_as_a_table() -> None:
    plan = solve(TOY, 12, input_bytes=1, slots=12)
    text = str(plan)
    assert text.splitlines()[0].startswith("remat schedule (optimal): 10 stages")
    assert "forward_checkpoint" in text and "backward" in text and "loss" in text
    assert len(text.splitlines()) == len(plan.ops) + 2


def test_baselines_under_the_model() -> None:
    assert Schedule.no_remat(TOY, input_bytes=1).makespan == 30
    assert Schedule.no_remat(TOY, input_bytes=1).peak_bytes == 23
    every = Schedule.recompute_all(TOY, input_bytes=1)
    assert every.makespan == 40 and every.extra_forwards() == 10
    assert Schedule.segments(TOY, 1, input_bytes=1).ops == Schedule.no_remat(TOY, input_bytes=1).ops
    two = Schedule.segments(TOY, 2, input_bytes=1)  # stages 0-4 checkpointed, 5-9 with grad
    assert two.extra_forwards() == 5 and two.makespan == 35
    with pytest.raises(ValueError, match=r"^remat: segments"):
        Schedule.segments(TOY, 11, input_bytes=1)


def test_invalid_schedules_and_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"^remat: invalid schedule"):
        Schedule.from_ops(TOY[:2], [("forward_save", 1)], input_bytes=1)
    with pytest.raises(ValueError, match=r"^remat: invalid schedule"):
        Schedule.from_ops(TOY[:1], [("forward_save", 0), ("loss", 1)], input_bytes=1)
    with pytest.raises(ValueError, match=r"^remat: "):
        StageCost(1.0, 1.0, output_bytes=4, saved_bytes=2)
    with pytest.raises(ValueError, match=r"^remat: "):
        StageCost(-1.0, 1.0, output_bytes=4, saved_bytes=4)
    with pytest.raises(ValueError, match=r"^remat: "):
        solve(TOY, -1, input_bytes=1)
    with pytest.raises(BudgetError, match=r"^remat: "):
        solve(TOY, 0, input_bytes=1)
    with pytest.raises(ValueError, match=r"^remat: "):
        solve([], 10, input_bytes=1)
    with pytest.raises(TypeError, match=r"^remat: "):
        solve([object()], 10, input_bytes=1)  # type: ignore[list-item]
