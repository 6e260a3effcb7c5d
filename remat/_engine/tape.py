"""Replay a recorded block's aten ops in backward (strategy "replay"; see the design page, "Rerun and replay").

`recorder.Recorder` records them in forward. See NOTE [ Policies on the tape ] and NOTE [ Replay script ].
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from .._core.errors import RematError
from .._core.torch_compat import any_autocast, version_of
from .autocast import AutocastState
from .debug import describe
from .kept import CHANGED_RANDOM, KeptOutput
from .recorder import Outside, Recorder, Slot, op_info
from .transfer import Parcel, Stay

__all__ = ["Tape"]

# NOTE [ Policies on the tape ]
# 1. With a policy, replay puts a kept output (of a chosen op, or a tensor `remat.tag` named for a saved name) into
#    its slot instead of running its op: a kept op never runs again, and its inputs are not needed.
# 2. A saved tensor that is a kept output, or a view of one, is kept by reference instead of rebuilt ("claimed").
# 3. As in rerun (NOTE [ What a policy keeps ] in selective.py), a kept output autograd does not save is dropped after
#    the replay that used it; a second replay (`retain_graph`) runs its op. One that autograd saves lives as long as
#    autograd keeps it (its token holds it, the tape weakly): a replay after the backward ops that read it released
#    it runs its op.
# 4. A kept output changed in place after it was kept, in forward or after it, is not kept: its op is replayed (NOTE
#    [ A kept output changed in place ] in kept.py).
# 5. A kept op that drew random numbers sets its generator, where replay would have run it, to the state forward
#    left it in (NOTE [ Random ops ] in rng.py), also when no saved tensor needs its outputs.
#
# Implementation notes:
# 1. (rule 1) The recorder keeps the chosen outputs detached, by slot.
# 2. (rule 4) Checked when forward ends and before every replay.
#
# NOTE [ Replay script ]
# 1. Forward does the least it can: the script (which ops are live, which argument slots each op reads, after which
#    op every slot is dropped, and after which op every saved tensor is complete) is built on the first replay and
#    reused by later ones (`retain_graph`).
# 2. An op whose outputs feed no saved tensor is skipped unless it writes memory or draws random numbers.
# 3. A saved tensor is taken after the op count it was saved at; if a later replayed op writes into its memory
#    (in-place on it or on a view), it is cloned when taken. One the next op writes through an argument it does not
#    return is that op's own, saved before it ran and read by backward as the op left it (`rrelu_with_noise`'s
#    noise, which the op fills): it is taken after that op, as autograd holds it.
#
# Implementation notes:
# 1. (rule 3) Forward notes such writes by the storage's identity (the one weak reference the region holds to it),
#    not by its address: an address is reused once a storage dies, and a write into a new tensor there must not
#    clone an old one.
#
# NOTE [ Shared scripts ]
# 1. Tapes of the same structure share one script: a script depends only on the tape's ops, where slots are read and
#    written, and the captures, and holds no values; replay reads every op and argument from its own tape.
# 2. Two tapes whose values differ but compare equal (`1` and `1.0`, `0.0` and `-0.0`) share a script and each
#    replays its own values.
# 3. A tape with outputs kept by a policy builds its own: which of them stay differs from run to run.
#
# Implementation notes:
# 1. (rule 1) A model runs the same block many times with the same shapes, and building a script is not free for a
#    transformer block. The scripts of recent structures are cached, found by op count, slot count and captures, and
#    taken only if the tape's entries equal the cached structure's (one comparison in C).

_Replayed = list[tuple[int, int, int, bool]]  # per capture: (handle, slot, op count at save, clone when taken)


class _Script:
    """What replay runs; see NOTE [ Replay script ]."""

    __slots__ = ("captures", "fills", "frees", "live")

    def __init__(
        self,
        live: list[bool],
        captures: list[list[tuple[int, int, bool]] | None],
        frees: list[list[int] | None],
        fills: list[list[int] | None] | None,
    ) -> None:
        self.live = live  # per op, whether replay runs it
        self.captures = captures
        self.frees = frees
        self.fills = fills  # per op, the kept output slots that stand for running it (None: no policy)


# See NOTE [ Shared scripts ]: (op count, slot count, captures) -> (the entries the script was made from, the script).
_SCRIPTS: dict[tuple[int, int, tuple[tuple[int, int, int, bool], ...]], tuple[list[Any], _Script]] = {}
_SCRIPTS_LOCK = threading.Lock()
_SCRIPTS_KEPT = 64


def _slots_in(value: Any, out: list[int]) -> None:
    if type(value) is Slot:
        out.append(value)
    elif type(value) is list or type(value) is tuple:
        for item in value:
            _slots_in(item, out)


def _fill(value: Any, values: list[Any]) -> Any:
    if type(value) is Slot:
        return values[value]
    if type(value) is list or type(value) is tuple:
        return type(value)(_fill(item, values) for item in value)
    return value


_INPLACE_OUTSIDE = (
    "remat: one of the variables needed for gradient computation has been modified by an inplace "
    "operation: a tensor of shape {shape} from outside region `{site}`, read by op #{op} ({name}) of its "
    "tape, was at version {before} when the region read it and is at version {after} now. Replay would run on "
    "the modified value and give wrong gradients. Don't modify tensors a region reads in place between its "
    "forward and backward (clone them first, or modify them inside the region)."
)


class Tape:
    """A finished recording: the ops of one forward of a region and what replay needs to run them again.

    Built by `Tape.finish` at the end of forward from a `Recorder`; `replay` runs in backward.
    """

    __slots__ = (
        "captures", "claimed", "draws", "generators", "kept", "lock", "ops", "outside", "points", "refused", "rng",
        "script", "site", "slots", "snapshots", "trace", "unrepeatable", "writes",
    )

    def __init__(
        self, recorder: Recorder, captures: list[tuple[int, int, int, weakref.ref[torch.UntypedStorage] | None]],
        site: str,
        claimed: frozenset[int] = frozenset(),
        final: bool = True,
    ) -> None:
        """`final=False`: a tape of the part of forward that has run, while the recorder still records (a
        backward inside the region); it leaves the recorder's records as they are."""
        self.site = site
        if recorder.snapshots:
            recorder._outside_storages()
        captures = _after_own_writes(captures, recorder.writes)
        stop = max((point for _, _, point, _ in captures), default=0)
        self.ops = recorder.ops[:stop]
        self.slots = recorder.slots
        self.outside = {slot: o for slot, o in recorder.outside.items() if o.first < stop}
        self.snapshots = {
            key: storage for key, storage in recorder.snapshots.items()
            if any(o.storage == key for o in self.outside.values())
        }
        for o in self.outside.values():
            if o.storage is not None and o.storage in self.snapshots:
                assert o.tensor is not None
                o.shape, o.stride = tuple(o.tensor.shape), tuple(o.tensor.stride())
                o.offset = int(o.tensor.storage_offset())
                if final:
                    o.tensor = None  # replay uses the snapshot; keeping the original could make a cycle
        self.writes = [write for write in recorder.writes if write[0] < stop]
        self.captures = captures
        self.points = {index: point for index, _, point, _ in captures}
        self.rng = recorder.rng() if recorder.preserve_rng else None
        self.generators = tuple(recorder.generators.items())
        self.trace = recorder.trace
        self.script: _Script | None = None
        self.lock = threading.Lock()
        # See NOTE [ Policies on the tape ]: a kept output changed in place after it was kept is not kept.
        end = self.ops[-1][3] + max(self.ops[-1][4], 1) if self.ops else 0
        # held weakly where autograd saves them, once forward ended (`hold_claimed_weakly`)
        self.kept: dict[int, KeptOutput | weakref.ref[KeptOutput]] = {
            slot: kept for slot, kept in recorder.kept.items() if slot < end
        }
        # kept random ops that replay cannot run again as they ran (no `preserve_rng`), and those of them whose
        # outputs changed: op -> (version kept, version now); replay raises if it must run one
        self.unrepeatable = frozenset(op for op in recorder.unrepeatable if op < stop)
        self.refused: dict[int, tuple[int, int]] = {}
        self.claimed = claimed
        self.draws = {op: draw for op, draw in recorder.draws.items() if op < stop} if recorder.draws else {}
        if self.kept:
            self._drop_changed(self._kept_now())

    def hold_claimed_weakly(self) -> None:
        """Hold the kept outputs autograd saves weakly: autograd's tokens hold them (`Frame.keep_held`), so that they
        die once the backward ops that read them have run (NOTE [ Policies on the tape ], rule 3)."""
        for slot in self.claimed:
            found = self.kept.get(slot)
            if isinstance(found, KeptOutput):
                self.kept[slot] = weakref.ref(found)

    def _kept_now(self) -> dict[int, KeptOutput]:
        """The kept outputs, held for one replay; those autograd has released since are gone, and the script that
        filled them is dropped (their ops run: NOTE [ Policies on the tape ], rule 3)."""
        kept: dict[int, KeptOutput] = {}
        gone: list[int] = []
        for slot, entry in self.kept.items():
            found = entry() if isinstance(entry, weakref.ref) else entry
            if found is None:
                gone.append(slot)
            else:
                kept[slot] = found
        if gone:
            with self.lock:
                for slot in gone:
                    self.kept.pop(slot, None)
                self.script = None
        return kept

    def hand_to(self, pack: Callable[[torch.Tensor], Any]) -> None:
        """Give the outside tensors to an enclosing pack hook (see NOTE [ Inputs of nested sites ])."""
        for o in self.outside.values():
            if o.tensor is not None:
                o.packed, o.tensor = pack(o.tensor), None
                o.version = -1

    def offload_kept(self, pack: Callable[[torch.Tensor], Parcel | Stay]) -> None:
        """Hold the outputs the policy keeps through an offload's `pack` (NOTE [ Offloaded sites ]), each with the
        version noted when it was kept (NOTE [ A kept output changed in place ] in kept.py)."""
        self.kept = {slot: kept.packed(pack) for slot, kept in self._kept_now().items()}

    def _drop_changed(self, kept: dict[int, KeptOutput]) -> None:
        """Stop keeping the outputs changed in place since they were kept (`kept`: `_kept_now`'s, which loses them
        too): replay runs their ops (NOTE [ A kept output changed in place ] in kept.py). Called when forward ends
        and before each replay."""
        moved = {slot: (output.version, output.now()) for slot, output in kept.items() if output.moved()}
        if not moved:
            return
        with self.lock:
            for slot in moved:
                self.kept.pop(slot, None)
                kept.pop(slot, None)
            self.script = None
        for op in self.unrepeatable:
            _, _, _, first, outputs, _ = self.ops[op]
            for slot in range(first, first + (1 if outputs < 0 else outputs)):
                if slot in moved:
                    self.refused[op] = moved[slot]

    # -- script ----------------------------------------------------------------------------------------------
    def _replayed(self) -> _Replayed:
        """The captures as the script sees them: a saved storage becomes whether a later op writes into it."""
        if not self.writes:
            return [(handle, slot, point, False) for handle, slot, point, _ in self.captures]
        last: dict[int, int] = {}  # the id of a saved storage's weak reference -> the last op that writes into it
        for op, storage, _ in self.writes:
            last[id(storage)] = op
        return [
            (handle, slot, point, storage is not None and last.get(id(storage), -1) >= point)
            for handle, slot, point, storage in self.captures
        ]

    def _script(self) -> _Script:
        """The script of this tape's structure: shared with earlier tapes of the same (NOTE [ Shared scripts ])."""
        replayed = self._replayed()
        if self.kept:
            return self._make_script(replayed)
        key = (len(self.ops), self.slots, tuple(replayed))
        found = _SCRIPTS.get(key)
        if found is not None:
            try:
                if found[0] == self.ops:
                    return found[1]
            except (RuntimeError, TypeError):  # a value whose `==` is no bool (a tensor the recorder missed)
                pass
        script = self._make_script(replayed)
        with _SCRIPTS_LOCK:
            while len(_SCRIPTS) >= _SCRIPTS_KEPT:
                del _SCRIPTS[next(iter(_SCRIPTS))]
            _SCRIPTS[key] = (self.ops, script)
        return script

    def _make_script(self, replayed: _Replayed) -> _Script:
        ops = self.ops
        count = len(ops)
        needed: set[int] = {slot for _, slot, _, _ in replayed}
        live = [False] * count
        reads: list[list[int]] = [[] for _ in range(count)]
        kept, drawn = self.kept, self.draws
        fills: list[list[int] | None] | None = [None] * count if kept else None
        for index in range(count - 1, -1, -1):
            func, args, kwargs, first, outputs, _ = ops[index]
            info = op_info(func)
            produced = range(first, first + (1 if outputs < 0 else outputs))
            if fills is not None and outputs != 0 and not info.writes and all(slot in kept for slot in produced):
                if any(slot in needed for slot in produced) or index in drawn:  # kept from forward: not run again
                    live[index] = True
                    fills[index] = list(produced)
                continue
            if info.writes or info.seeded or any(slot in needed for slot in produced):
                live[index] = True
                slots: list[int] = []
                _slots_in(args, slots)
                if kwargs:
                    _slots_in(list(kwargs.values()), slots)
                reads[index] = slots
                needed.update(slots)
        last: dict[int, int] = {}
        for index in range(count):
            if not live[index]:
                continue
            func, args, kwargs, first, outputs, _ = ops[index]
            for slot in range(first, first + (1 if outputs < 0 else outputs)):
                last[slot] = index
            for slot in reads[index]:
                last[slot] = index
        captures: list[list[tuple[int, int, bool]] | None] = [None] * count
        for handle, slot, point, clone in replayed:
            at = point - 1
            if captures[at] is None:
                captures[at] = []
            captures[at].append((handle, slot, clone))  # type: ignore[union-attr]
            last[slot] = max(last.get(slot, at), at)
        frees: list[list[int] | None] = [None] * count
        for slot, index in last.items():
            if frees[index] is None:
                frees[index] = []
            frees[index].append(slot)  # type: ignore[union-attr]
        if fills is not None:
            live = [run and fills[index] is None for index, run in enumerate(live)]
        return _Script(live, captures, frees, fills)

    # -- replay --------------------------------------------------------------------------------------------
    def _outside_value(
        self, o: Outside, storages: dict[int, torch.UntypedStorage], unpack: Callable[[Any], Any] | None,
        op: int,
    ) -> torch.Tensor:
        if o.storage is not None and o.storage in self.snapshots:
            storage = storages.get(o.storage)
            if storage is None:
                storage = storages[o.storage] = self.snapshots[o.storage].clone()  # type: ignore[no-untyped-call]
            view = torch.empty(0, dtype=o.dtype, device=storage.device)
            return view.set_(storage, o.offset, o.shape, o.stride)
        if o.tensor is None:
            assert unpack is not None
            return unpack(o.packed)  # type: ignore[no-any-return]
        tensor = o.tensor
        if version_of(tensor) != o.version:
            raise RematError(
                _INPLACE_OUTSIDE.format(
                    shape=list(tensor.shape), site=self.site, op=op, name=op_info(self.ops[op][0]).name,
                    before=o.version, after=tensor._version,
                )
            )
        return tensor

    def replay(
        self,
        wanted: set[int],
        emit: Callable[[int, torch.Tensor], None],
        unpack: Callable[[Any], Any] | None,
        retrace: list[str] | None,
    ) -> None:
        """Run the ops up to the last one that `wanted` saved tensors need, and `emit` each of them.

        Args:
            wanted: handle indices to rebuild.
            emit: called with (handle index, tensor) as soon as a tensor is complete.
            unpack: the enclosing unpack hook, for outside tensors that were handed to it.
            retrace: under REMAT_DEBUG, receives one line per replayed op.
        """
        stop = max(self.points[index] for index in wanted)
        kept = self._kept_now() if self.kept else {}
        if kept:
            self._drop_changed(kept)
        for op, (before, after) in self.refused.items():
            if op < stop:
                func = self.ops[op][0]
                raise RematError(CHANGED_RANDOM.format(site=self.site, op=func, before=before, after=after))
        script = self.script
        if script is None:
            with self.lock:
                script = self.script
                if script is None:
                    script = self.script = self._script()
        values: list[Any] = [None] * self.slots
        storages: dict[int, torch.UntypedStorage] = {}
        for slot, o in self.outside.items():
            if o.first < stop:
                values[slot] = self._outside_value(o, storages, unpack, o.first)
        ops, live, captures, frees, fills = self.ops, script.live, script.captures, script.frees, script.fills
        with ExitStack() as stack:
            if self.rng is not None:
                stack.enter_context(self.rng.restore())
            for generator, state in self.generators:
                stack.enter_context(_generator_fork(generator, state))
            if any_autocast():
                stack.enter_context(AutocastState.enter(None, ()))
            # Without grad, also under `create_graph=True`: replay rebuilds data, to which autograd attaches
            # forward's grad_fn. A graph built here would save tensors into whatever saved-tensor hooks are on top
            # (an enclosing site whose function runs backward), as many as the values it reads require grad.
            stack.enter_context(torch.no_grad())
            for index in range(stop):
                if live[index]:
                    func, args, kwargs, first, outputs, _ = ops[index]
                    call_args = [
                        values[a] if type(a) is Slot
                        else (_fill(a, values) if type(a) is list or type(a) is tuple else a)
                        for a in args
                    ]
                    if kwargs:
                        out = func(*call_args, **{k: _fill(v, values) for k, v in kwargs.items()})
                    else:
                        out = func(*call_args)
                    if outputs < 0:
                        values[first] = out
                    elif outputs:
                        values[first:first + outputs] = out
                    if retrace is not None:
                        retrace.append(describe(func, out))
                elif fills is not None and (filled := fills[index]) is not None:
                    for slot in filled:
                        value = kept[slot].value
                        values[slot] = value.detach() if isinstance(value, torch.Tensor) else value.get()
                    if self.draws and (draw := self.draws.get(index)) is not None:
                        draw.set(None)  # within the stash's fork: the recorder stashed this generator
                taken = captures[index]
                if taken is not None:
                    for handle, slot, clone in taken:
                        if handle in wanted:
                            value = values[slot]
                            emit(handle, value.clone() if clone else value)
                dropped = frees[index]
                if dropped is not None:
                    for slot in dropped:
                        values[slot] = None
        if fills is not None:
            self._drop_unclaimed()

    def _drop_unclaimed(self) -> None:
        """After a replay, drop the kept outputs autograd does not save (see NOTE [ Policies on the tape ])."""
        with self.lock:
            dropped = [slot for slot in self.kept if slot not in self.claimed]
            if dropped:
                for slot in dropped:
                    del self.kept[slot]
                self.script = None  # the next replay (retain_graph) runs those ops again


class _generator_fork:
    __slots__ = ("caller", "generator", "state")

    def __init__(self, generator: torch.Generator, state: torch.Tensor) -> None:
        self.generator, self.state = generator, state
        self.caller: torch.Tensor | None = None

    def __enter__(self) -> None:
        self.caller = self.generator.get_state()
        self.generator.set_state(self.state)

    def __exit__(self, *exc: object) -> None:
        assert self.caller is not None
        self.generator.set_state(self.caller)


_Capture = tuple[int, int, int, "weakref.ref[torch.UntypedStorage] | None"]


def _after_own_writes(captures: list[_Capture],
                      writes: list[tuple[int, weakref.ref[torch.UntypedStorage], bool]]) -> list[_Capture]:
    """The captures, each one the next op writes through an argument it does not return taken after that op (NOTE
    [ Replay script ], rule 3): its autograd saved it before the op filled it."""
    if not writes:
        return captures
    beside = {(op, id(storage)) for op, storage, aside in writes if aside}
    return [(handle, slot, point + 1, storage)
            if storage is not None and (point, id(storage)) in beside else (handle, slot, point, storage)
            for handle, slot, point, storage in captures]

