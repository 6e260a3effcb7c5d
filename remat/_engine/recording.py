"""The replay regions recording on this thread, so that a recompute keeps its ops off their tapes.

NOTE [ Recompute is not recorded ]
A backward that a region's forward runs (a gradient inside the block) may make a site recompute: a rerun site
calls its function again under forward's RNG state, a replay site replays its tape. Those ops are not the block's:
what they rebuild enters the block only through the unpack hook, as a new tensor the tape keeps as one from
outside. Recorded, a replay of the block would run them again, with the block's RNG state instead of the state
they ran under, and rebuild other values. So every recording on the thread is paused while a recompute runs.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["pause", "recording", "resume"]


class _Recording(threading.local):
    def __init__(self) -> None:
        self.stack: list[Any] = []  # the recorders (`recorder.Recorder`) of the regions open on this thread


_recording = _Recording()


def recording() -> list[Any]:
    """This thread's open recorders, innermost last: a region pushes its recorder when it opens, pops it when it
    ends."""
    return _recording.stack


def pause() -> list[tuple[Any, bool]] | None:
    """Pause every recorder of this thread; None when there is none (the common case: one attribute read)."""
    stack = _recording.stack
    if not stack:
        return None
    paused = [(recorder, recorder.paused) for recorder in stack]
    for recorder in stack:
        recorder.paused = True
    return paused


def resume(paused: list[tuple[Any, bool]] | None) -> None:
    """Undo `pause`."""
    if paused is not None:
        for recorder, flag in paused:
            recorder.paused = flag
