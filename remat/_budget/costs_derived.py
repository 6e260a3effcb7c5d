"""Costs derived rather than run: what a block costs under full remat, `save_matmuls` and the parts, from one tracked
run of it kept.

NOTE [ Deriving choices ]
What a rematerialized block does is a replay of what it does kept, and the tracker sees every op of that: so one
tracked run of a block kept gives its other choices, in the terms of NOTE [ Budget model ] in costs.py, without
the tracked round per choice (each slower than a plain step) that running them would take.

Rules:
1. One tracked run of a block kept (`KeptRun`, filled by profile.py from the window's `Detail` in
   profile_step.py) gives
   its costs under full remat, `save_matmuls` and the choices that keep some matmuls (NOTE [ Some matmuls ]).
   Under choice c, with "born" the storages its forward allocated:
   * held bytes: the born storages of its outputs (what the next block reads), plus, for `save_matmuls`, every
     storage a matmul-class op made (the policy keeps them all until recompute; NOTE [ What a policy keeps ]) but
     those a later op of the block changed in place, which the policy does not keep and recompute rebuilds, as
     under full remat (NOTE [ A kept output changed in place ] in remat/_engine/kept.py),
     plus under autocast the casts of its parameters that autocast caches, which live to the end of the step's
     autocast region, after the last forward, whatever the block does (counted through backward too, where they
     are gone: an overestimate by those casts of the blocks before, while backward runs);
     its inputs are held by whoever made them, whatever this block does;
   * forward peak: under full remat, kept's (a bound); under `save_matmuls`, kept's allocation log replayed;
   * backward peak: the larger of recompute on top of what is live when backward starts, and kept's backward;
   * times: the forward is kept's; the backward is kept's plus a recompute, which is kept's forward less its
     matmul-class ops under `save_matmuls` (those whose output the block changes in place run again: not less
     them), plus the dispatch mode's cost per op where c runs one.
2. This rests on NOTE [ Budget model ]'s premise that a block holds what its forward left alive until its own
   backward. Where that fails, blocks' numbers depend on the choices around them, so the profiled step checks it
   when backward starts, and the derivable choices are run instead where it fails (NOTE [ Profiling rounds ]):
   one more tracked step or more, and measured numbers.
3. Forward peaks are a bound (full remat) or an estimate (`save_matmuls`), the rest a model:
   tests/budget/test_budget_derive.py checks derived against measured costs on small models, and the benchmark prints
   predicted against measured peaks and times.

Implementation notes:
1. (rule 1, forward peak) Kept's peak bounds full remat's from above (rerun frees what kept's autograd saves as
   soon as the block's Python drops it, which the log cannot tell), and it is not what binds, since backward
   starts above the forward's start (the output's gradient at least) and replays the same log. Under
   `save_matmuls` the matmul outputs never die before recompute, and recompute hands them back and drops them,
   so the forward can peak above the recompute and kept's peak is no bound: the forward's log is replayed with
   the matmul outputs never released and what kept's autograd saved (born, never released, neither output nor
   matmul) released once the last op of the block that reads it has run (its outputs allocated), as a temporary
   dies after the op that reads it last; one that no later op reads, at the next allocation. That is exact where
   the block's Python keeps no local alive past its last read, and low where it does, where backward peaks higher
   anyway (docs/benchmarks.md). (Released at the next allocation instead, a softmax's output died before the
   dropout that reads it had made its mask and output: GPT-2's derived forward peak came out low by two of its
   attention's score tensors.)
2. (rule 1, backward peak) Backward starts at what kept started at (`at_backward`, above S_i), less the born
   storages kept still held then (`alive`), plus those that c holds then: the matmul outputs under
   `save_matmuls`, and the outputs that something outside the block still holds (`live_outputs`). An output can
   be live at backward only through the block's own saved tensors (an op that saves its result, such as a final
   ReLU: rerun drops that) or through a reference from outside (kept whatever the block does). Autograd saves a
   result as a new tensor on the same storage, so the two differ in whether the output's own tensor object is
   still alive, which a weak reference tells. Recompute then replays the forward's allocation log on top (a
   matmul output under `save_matmuls` is handed back, not allocated again); after it, what recompute built that
   backward does not need is gone as it was in kept's run, and backward runs as kept's did (its peak is an upper
   bound: rerun's backward may hold a little less).
3. (rule 1, times) Each op's time is measured from the end of the op before, so the Python between ops counts in
   the non-matmul part. `save_matmuls` runs a dispatch mode over every op in forward and in recompute: `ops`
   times its cost per op (`mode_overhead`, calibrated once per process). Where a device runs asynchronously
   (CUDA) the tracked step is not timed and its matmul times are only the launches: recompute under
   `save_matmuls` then counts as much as a whole forward (an overestimate).
4. (rule 2) Hugging Face decoder layers free some of what their forwards left alive before the first backward
   starts, and derived plans' peaks then come out low (docs/benchmarks.md). The check is profile_step.py's
   `_early_deaths`; where more than `_EARLY` of those bytes died early (profile.py), the choices are run.
5. (rule 3) Derived backward times of full remat and `save_matmuls` come out low against running each choice
   (docs/benchmarks.md): a recompute runs slower than the forward it repeats, and rerun's hooks cost something
   per call and per saved tensor, none of which is modelled.
"""

from __future__ import annotations

from collections.abc import Collection

from .profile import DERIVABLE, PARTS, KeptRun
from .profile_step import Detail

__all__ = ["changed_calls", "compiled_times", "derive_bytes", "derive_times", "output_calls", "part_calls"]

# NOTE [ Outputs no one reads ]
# A block may return more than the next block reads: transformers' Falcon with eager attention returns its layer's
# attention weights (batch x heads x seq^2), and the model drops them. Kept, the block saves them for its backward
# anyway; rematerialized, it does not, and they live only as long as the model's code holds them.
#
# Rules:
# 1. The profile notes which of a block's outputs an op after its forward reads before backward starts
#    (`KeptRun.read_outputs`: the next block's input, the loss's). The derived choices hold only those through
#    backward, and count only those as held from outside when backward starts.
# 2. The others stay alive as long as the model holds the block's result, at most until the next block's forward
#    has returned (a loop variable assigned again): their bytes add to the next block's forward peak under every
#    choice (kept, the block holds them anyway: an overestimate by them), and the last block's to the window
#    after the last forward (its final norm; the loss after it: an overestimate there).
#
# Implementation notes:
# 1. (rule 1) A weak reference to the output tensor cannot tell: autograd saves an input of an op as the tensor
#    itself, and torch keeps its Python object alive while autograd holds it. The tracker notes the reads
#    (`Windows.watched` in profile_step.py) from the block's forward end to the first backward.
# 2. Before, Falcon's predicted full remat came out 1.5-1.7 times the real step's (docs/benchmarks.md, "A budget
#    across families").

# NOTE [ Some matmuls ]
# Between full remat (keep nothing but the output) and `save_matmuls` (keep every matmul-class output) a block
# may keep some of its matmul outputs, as torch's selective checkpointing planner does op by op.
#
# Rules:
# 1. The calls kept are those that give back the most recompute time per byte kept (an attention kernel: a small
#    output for a long op; a projection down from a wide MLP), taken in that order while their bytes stay within a
#    share of all the matmul outputs' bytes (`PARTS`: a quarter, a half), a call too large for what is left
#    skipped.
# 2. The calls are numbered in the order the block's forward makes them, chosen per kind of block from the first
#    of its kind recorded kept (so that blocks of a kind keep the same calls), and carried out by a policy that
#    keeps just those calls (NOTE [ Some calls ] in remat/_core/policies.py).
# 3. A call that makes one of the block's outputs is never picked, nor in eager code one whose output the block
#    changes in place (the policy would not keep it: NOTE [ A kept output changed in place ] in
#    remat/_engine/kept.py). A share that picks no call, or every call it may, is not offered (it would be full
#    remat or `save_matmuls` again).
#
# Implementation notes:
# 1. (rule 2) The derivation is `save_matmuls`' with their storages in place of every matmul output's, and their
#    time in place of every matmul's (NOTE [ Deriving choices ]).
# 2. (rule 3) The block holds that output anyway, and recompute, which stops after the last tensor backward wants
#    (NOTE [ Early stop ] in rerun.py), seldom reaches it, so keeping it saves no time (picked by its measured
#    time, it made the choice between such a part and full remat a matter of noise).
# 3. (rule 1) Times per call are those of the tracked step: where a device runs asynchronously they are
#    launches, so the order is by bytes in effect and the recompute is counted as a whole forward, as for
#    `save_matmuls`.


def changed_calls(detail: Detail) -> set[int]:
    """The matmul-class calls whose output the block changed in place after the call (`Detail.changed`): eager code
    keeps none of them (NOTE [ A kept output changed in place ] in remat/_engine/kept.py).

    >>> d = Detail()
    >>> d.calls, d.changed = {3: 0, 5: 1}, {5}
    >>> changed_calls(d)
    {1}
    """
    return {detail.calls[number] for number in detail.changed if number in detail.calls}


def output_calls(detail: Detail, outputs: frozenset[int]) -> set[int]:
    """The matmul-class calls that made one of `outputs` (storages of `detail`): never a part's (NOTE [ Some
    matmuls ])."""
    return {call for number, call in detail.calls.items() if number in outputs}


def part_calls(
    share: float, detail: Detail, outputs: frozenset[int] = frozenset(), changed: Collection[int] = frozenset()
) -> frozenset[int]:
    """The matmul-class calls (numbered in order) that a part keeps: NOTE [ Some matmuls ]; never one of `changed`
    (`changed_calls`, in eager code).

    >>> d = Detail()
    >>> d.born, d.calls, d.call_time = {0: 8, 1: 2, 2: 8}, {0: 0, 1: 1, 2: 2}, [1.0, 1.0, 3.0]
    >>> sorted(part_calls(0.6, d)), sorted(part_calls(0.25, d))  # call 1 gives the most seconds per byte
    ([1, 2], [1])
    >>> sorted(part_calls(0.6, d, outputs=frozenset({1})))  # call 1 makes the block's output: never a choice
    [2]
    """
    size = [0] * len(detail.call_time)
    for number, call in detail.calls.items():
        size[call] += detail.born[number]
    ends = output_calls(detail, outputs) | set(changed)
    room = share * sum(size)
    chosen = []
    for call in sorted(range(len(size)), key=lambda c: (-detail.call_time[c] / max(1, size[c]), c)):
        if call not in ends and size[call] <= room:
            chosen.append(call)
            room -= size[call]
    return frozenset(chosen)


def _replay(detail: Detail, saved: frozenset[int] | set[int], handed: bool, keep: bool,
            drop: frozenset[int] = frozenset()) -> int:
    """The peak of the forward's allocation log, from 0 (see NOTE [ Deriving choices ]).

    saved: the matmul outputs the choice keeps.
    handed: they are not allocated (recompute gets them back).
    keep: they are never released (forward keeps them).
    drop: storages never released in the log that are released once the last op that reads them has run, or,
        read by none, once the next storage is allocated.
    """
    last = {number: i for i, (number, delta) in enumerate(detail.events) if delta == 0 and number in drop}
    level = peak = pending = 0
    for i, (number, delta) in enumerate(detail.events):
        if delta == 0:
            if last.get(number) == i:
                level -= detail.born[number]
            continue
        if number in saved and ((handed and delta > 0) or (keep and delta < 0)):
            continue
        level += delta
        peak = max(peak, level)
        if delta > 0:
            level -= pending
            pending = detail.born[number] if number in drop and number not in last else 0
    return peak


def _kept_storages(
    choice: str, detail: Detail, calls: frozenset[int] | None, compiled: bool = False
) -> frozenset[int] | set[int]:
    """The storages of `detail` that `choice` keeps besides the outputs: in eager code not those the block changed in
    place (NOTE [ Deriving choices ]); compiled code functionalises the change and keeps them."""
    if choice == "full":
        return frozenset()
    changed = frozenset() if compiled else detail.changed
    if choice == "save_matmuls":
        return detail.matmul - changed if changed else detail.matmul
    if choice in PARTS and calls is not None:
        return frozenset(n for n, call in detail.calls.items() if call in calls and n not in changed)
    raise ValueError(
        f"remat: cannot derive choice {choice!r}; derivable: {', '.join(DERIVABLE)} (the parts with their calls)."
    )


def derive_bytes(
    choice: str, kept: KeptRun, calls: frozenset[int] | None = None, compiled: bool = False
) -> tuple[int, int, int]:
    """Held bytes, forward peak and backward peak (above S_i) of a block under `choice`, from its run kept.

    `calls`: for a part (`PARTS`), the matmul-class calls it keeps (`part_calls`). `compiled`: the choice runs in
    compiled code, which keeps the matmul outputs the block changes in place too (NOTE [ Compiled costs ]).

    >>> d = Detail()
    >>> d.born, d.matmul, d.calls, d.events = {1: 8, 2: 4}, {1}, {1: 0}, [(1, 8), (2, 4)]  # a matmul, the output
    >>> kept = KeptRun(0, 12, 12, 20, 16, 12, frozenset({2}), frozenset({2}), frozenset({2}), d)
    >>> derive_bytes("full", kept), derive_bytes("save_matmuls", kept), derive_bytes("save_matmuls/2", kept, {0})
    ((4, 12, 20), (12, 12, 20), (12, 12, 20))
    """
    detail = kept.detail
    born = detail.born
    saved = _kept_storages(choice, detail, calls, compiled)
    # the outputs a later op reads (NOTE [ Outputs no one reads ]); autocast's casts, to the region's end
    holds = kept.read_outputs | saved | detail.cached
    held = sum(born[key] for key in holds)
    forward_peak = kept.forward_peak
    handed = choice != "full"
    if handed:
        released = {number for number, delta in detail.events if delta < 0}
        dropped = frozenset(n for n in born if n not in released and n not in holds)  # saved by kept's autograd
        forward_peak = kept.base + _replay(detail, saved, handed=False, keep=True, drop=dropped)
    live = (kept.live_outputs & kept.read_outputs) | saved  # born storages live at backward under c
    start = kept.at_backward - kept.alive + sum(born[key] for key in live)
    rise = _replay(detail, saved, handed=handed, keep=False)
    backward_peak = max(start + rise, kept.backward_peak)
    return held, forward_peak, backward_peak


def derive_times(
    choice: str, forward: float, backward: float, matmul: float, ops: float, per_op: float
) -> tuple[float, float]:
    """Forward and backward seconds of a block under `choice`, from its times kept (NOTE [ Deriving choices ]).

    `matmul`: the seconds of the matmul-class calls `choice` keeps (all of them for `save_matmuls`).

    >>> derive_times("full", 1.0, 2.0, 0.5, 10, 0.01), derive_times("save_matmuls", 1.0, 2.0, 0.5, 10, 0.01)
    ((1.0, 3.0), (1.1, 2.6))
    """
    if choice == "full":
        return forward, backward + forward
    if choice == "save_matmuls" or choice in PARTS:
        mode = ops * per_op
        return forward + mode, backward + max(0.0, forward - matmul) + mode
    raise ValueError(f"remat: cannot derive choice {choice!r}; derivable: {', '.join(DERIVABLE)}.")


# NOTE [ Compiled costs ]
# 1. Inside one compiled graph (`remat.apply(..., compile=True)`) a choice runs as torch's checkpoint operator with a
#    selective policy, and the compiler fuses a block's pointwise ops into the kernels around them: a recompute
#    repeats at a cost only its matmul-class calls, and no dispatch mode runs.
# 2. So there a derived choice's backward is kept's plus the seconds of the matmul-class calls it does not keep (all
#    of them under full remat, none under `save_matmuls`); its forward is kept's. Choices run rather than derived
#    keep their eager times.
# 3. A matmul output the block changes in place is kept there like any other: the compiler functionalises the change
#    and saves the op's own value (NOTE [ Under torch.compile ] in remat/_engine/compiled.py), where eager code runs
#    the op again (NOTE [ Deriving choices ]).
#
# Implementation notes:
# 1. (rule 2) Compiled, `save_matmuls` runs about as fast as kept, which eager costs (with the dispatch mode's price
#    per op) would not say (docs/benchmarks.md).


def compiled_times(choice: str, forward: float, backward: float, every: float, kept: float) -> tuple[float, float]:
    """Forward and backward seconds of a block under `choice` in one compiled graph (NOTE [ Compiled costs ]).

    `every`: the seconds of all the block's matmul-class calls; `kept`: of those `choice` keeps (a part's).

    >>> compiled_times("full", 1.0, 2.0, 0.5, 0.0), compiled_times("save_matmuls", 1.0, 2.0, 0.5, 0.5)
    ((1.0, 2.5), (1.0, 2.0))
    >>> compiled_times("save_matmuls/2", 1.0, 2.0, 0.5, 0.25)
    (1.0, 2.25)
    """
    if choice == "full":
        return forward, backward + every
    if choice == "save_matmuls":
        return forward, backward
    if choice in PARTS:
        return forward, backward + max(0.0, every - kept)
    raise ValueError(f"remat: cannot derive choice {choice!r}; derivable: {', '.join(DERIVABLE)}.")


# NOTE [ Mode cost in place ]
# 1. `save_matmuls` and the parts run a dispatch mode over every op of the block, in forward and in recompute; their
#    derived times count its cost per op, calibrated once on a small op with two arguments (`mode_overhead`): a floor.
# 2. A mode's Python sees every argument of every op, so it costs more per op on ops that carry many (a Hugging Face
#    layer's). Where the profile times a block alone (NOTE [ Timing under the tracker ] in profile_step.py), it also
#    times that block's forward under the mode, and the cost per op is the larger of the two.
#
# Implementation notes:
# 1. (rule 2) On the floor alone, the derived recompute of `save_matmuls` came out cheaper than full remat's on
#    layers where the two measured the same (docs/benchmarks.md).


