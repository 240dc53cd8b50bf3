"""How long this process spent blocked in communication.

    with comm.BlockedTimer() as blocked:
        loss.backward()
    blocked.seconds            # total
    blocked.by_op["all_gather"]

Blocked time is host wall time inside a synchronous collective, plus time inside the
`wait()` of an asynchronous one. Time an async collective spends in flight while the
caller computes is not blocked: it is the communication that overlap hid. So
`blocked.seconds` is the exposed communication time of a step, to compare with and
without overlap. Like the counters, timers are process-wide (a collective issued by an
autograd thread counts too); `collectives` checks `active()` first, so nobody pays for
the clock when no timer listens. Object collectives (metadata) are not timed.
"""

from __future__ import annotations

import threading

from typing_extensions import Self

_timers: list[BlockedTimer] = []
_lock = threading.Lock()


def active() -> bool:
    return bool(_timers)


def add(op: str, seconds: float) -> None:
    with _lock:
        for timer in _timers:
            timer.by_op[op] = timer.by_op.get(op, 0.0) + seconds


class BlockedTimer:
    """Accumulates seconds blocked in communication, per collective kind, while active."""

    def __init__(self) -> None:
        self.by_op: dict[str, float] = {}

    @property
    def seconds(self) -> float:
        with _lock:
            return sum(self.by_op.values())

    def __enter__(self) -> Self:
        with _lock:
            _timers.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        with _lock:
            _timers[:] = [t for t in _timers if t is not self]
