"""Counting the bytes each rank moves, per collective kind.

Every collective in `meshspeed.comm` calls `record` exactly once per call; that single
hook feeds every active sink (`CommCounter`, `CommLogger`). Sinks are process-wide, not
per thread, so a collective launched from another thread (an autograd or prefetch
thread) is still counted; a lock keeps concurrent updates consistent.

Note [ring bytes]: `bytes` is what this rank sends in a bandwidth-optimal ring
algorithm over the N ranks of the group used, with S the bytes of the full, unsharded
tensor:

    all_reduce      2(N-1)/N * S    reduce-scatter then all-gather
    all_gather       (N-1)/N * S    S = bytes of the gathered output
    reduce_scatter   (N-1)/N * S    S = bytes of the unreduced input
    all_to_all       (N-1)/N * S    S = bytes of the input; with uneven input splits,
                                    exactly the input bytes not kept by this rank
    broadcast        (N-1)/N * S    pipelined (chunked) ring or scatter+all-gather:
                                    on average each rank forwards (N-1)/N of S
    send / recv           S

The fraction is computed in exact integer arithmetic and rounded (half up) to an int
once per call. With N = 1 every collective moves 0 bytes but still counts as a call.
"""

from __future__ import annotations

import threading
from typing import Protocol

from typing_extensions import Self

# Every op name a summary reports, in display order.
COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")

_RING_FACTOR = {  # op -> k in bytes = k(N-1)S/N
    "all_reduce": 2,
    "all_gather": 1,
    "reduce_scatter": 1,
    "all_to_all": 1,
    "broadcast": 1,
}


def ring_bytes(op: str, nbytes: int, group_size: int) -> int:
    """Bytes one rank moves for `op` on a full tensor of `nbytes` over `group_size` ranks."""
    if op in ("send", "recv"):
        return nbytes
    try:
        k = _RING_FACTOR[op]
    except KeyError:
        raise ValueError(f"unknown collective {op!r}; expected one of {COMM_OPS}") from None
    n = group_size
    if n < 1:
        raise ValueError(f"group_size must be >= 1, got {n}")
    return (2 * k * (n - 1) * nbytes + n) // (2 * n)  # round(k(N-1)S/N), half up


class CommSink(Protocol):
    def on_collective(self, op: str, nbytes: int, seconds: float) -> None: ...

    # optional: `on_group(op, nbytes, ranks)` as well, with the global ranks of the group
    # the call ran on (a sink that tells links apart, e.g. inside and across nodes)


_sinks: list[CommSink] = []
stats_lock = threading.Lock()  # guards the sink list and every sink's statistics


def record(op: str, nbytes: int, seconds: float = 0.0, ranks: tuple[int, ...] = ()) -> None:
    """The single counting hook: one call of `op` that moved `nbytes` from this rank, on
    the group of global `ranks`."""
    with stats_lock:
        for sink in _sinks:
            sink.on_collective(op, nbytes, seconds)
            on_group = getattr(sink, "on_group", None)
            if on_group is not None:
                on_group(op, nbytes, ranks)


def has_sinks() -> bool:
    """Cheap check so collectives skip timing when nobody is listening."""
    return bool(_sinks)


def attach(sink: CommSink) -> None:
    with stats_lock:
        if not any(s is sink for s in _sinks):
            _sinks.append(sink)


def detach(sink: CommSink) -> None:
    with stats_lock:
        _sinks[:] = [s for s in _sinks if s is not sink]


def reset_for_tests() -> None:
    """Detach every sink (the test harness calls this between calls)."""
    with stats_lock:
        _sinks.clear()


class CommCounter:
    """Counts calls and ring bytes per collective on this rank while active.

        with CommCounter() as counter:
            ...
        counter.summary()["all_reduce"]["bytes"]

    Counters nest: every active counter sees every call. `summary()` always contains all
    seven op names of COMM_OPS (zeros for ops not called). Object collectives and
    barriers are not counted.
    """

    def __init__(self) -> None:
        self._calls = dict.fromkeys(COMM_OPS, 0)
        self._bytes = dict.fromkeys(COMM_OPS, 0)
        self._by_group: dict[tuple[int, ...], dict[str, int]] = {}

    def __enter__(self) -> Self:
        attach(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        detach(self)

    def on_collective(self, op: str, nbytes: int, seconds: float) -> None:
        self._calls[op] += 1
        self._bytes[op] += nbytes

    def on_group(self, op: str, nbytes: int, ranks: tuple[int, ...]) -> None:
        by_op = self._by_group.setdefault(tuple(sorted(ranks)), dict.fromkeys(COMM_OPS, 0))
        by_op[op] += nbytes

    def by_group(self) -> dict[tuple[int, ...], dict[str, int]]:
        """{sorted global ranks of a group: {op: bytes}} for every group a call ran on: which
        link moved the bytes (ZeRO++ hpZ keeps backward gathers inside a node's group)."""
        with stats_lock:
            return {ranks: dict(by_op) for ranks, by_op in self._by_group.items()}

    def bytes_outside(self, ranks) -> int:
        """Bytes of calls on groups that are not inside `ranks` (e.g. one node's ranks)."""
        inside = set(ranks)
        return sum(sum(by_op.values()) for group, by_op in self.by_group().items()
                   if not inside.issuperset(group))

    def summary(self) -> dict[str, dict[str, int]]:
        with stats_lock:
            return {op: {"calls": self._calls[op], "bytes": self._bytes[op]} for op in COMM_OPS}

    def total_bytes(self) -> int:
        with stats_lock:
            return sum(self._bytes.values())

    def reset(self) -> None:
        with stats_lock:
            self._calls = dict.fromkeys(COMM_OPS, 0)
            self._bytes = dict.fromkeys(COMM_OPS, 0)
            self._by_group = {}
