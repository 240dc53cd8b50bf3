"""`SlowLink`: make collectives take time, as on a slow link, to test and show overlap.

    with SlowLink(latency=0.002, seconds_per_mb=0.05):
        ...

Each collective occupies one simulated link for `latency + MB moved * seconds_per_mb`
(MB = 1e6 of the ring bytes `counter` counts), starting when the link is free (so works
in flight queue behind each other, as on one link). A synchronous call returns when its
transfer ends; an asynchronous work's `wait()` returns no earlier than that: time the
caller spends computing before `wait()` hides it, which is what overlap is for. Tests use
it to show results do not depend on when communication completes, and benchmarks to show
`comm.BlockedTimer` (exposed time) with and without overlap. Patches
`meshspeed.comm.collectives` for the duration of the block (test use only); metadata
(object) collectives are not slowed.

`node_size=K` slows only the links between nodes: ranks [0, K), [K, 2K), ... are nodes,
and a collective whose group lies inside one node runs at the loopback's own speed, as
over NVLink, while one spanning nodes takes the slow link (ZeRO++'s setting: hpZ keeps
backward gathers inside a node).
"""

from __future__ import annotations

import time
from typing import Any

from typing_extensions import Self

from meshspeed.comm import blocked, collectives, sequence


class _DelayedWork:
    def __init__(self, work: Any, ready_at: float) -> None:
        self._work, self._ready_at = work, ready_at

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        done = self._work.wait(*args, **kwargs)
        _sleep_until(self._ready_at)
        return done

    def is_completed(self) -> bool:
        return time.perf_counter() >= self._ready_at and self._work.is_completed()


def _sleep_until(t: float) -> None:
    left = t - time.perf_counter()
    if left > 0:
        time.sleep(left)


class SlowLink:
    def __init__(self, latency: float = 0.0, *, seconds_per_mb: float = 0.0, node_size: int | None = None) -> None:
        if node_size is not None and node_size < 1:
            raise ValueError(f"node_size must be a positive number of ranks, got {node_size}")
        self.latency, self.seconds_per_mb, self.node_size = latency, seconds_per_mb, node_size
        self._issue: Any = None
        self._free_at = 0.0

    def _ready_at(self, nbytes: int) -> float:
        start = max(time.perf_counter(), self._free_at)
        self._free_at = start + self.latency + nbytes / 1e6 * self.seconds_per_mb
        return self._free_at

    def _inside_a_node(self, group: Any) -> bool:
        if self.node_size is None:
            return False
        return len({r // self.node_size for r in sequence.members(group)}) == 1

    def __enter__(self) -> Self:
        self._issue = issue = collectives._issue

        def slow_issue(op: str, nbytes: int, *args: Any, counted: bool = True, **kwargs: Any) -> Any:
            work = issue(op, nbytes, *args, counted=counted, **kwargs)
            if not counted or self._inside_a_node(args[0] if args else kwargs.get("group")):
                return work
            ready = self._ready_at(nbytes)
            if work is None:  # the transfer is part of the caller's synchronous collective
                start = time.perf_counter()
                _sleep_until(ready)
                if blocked.active():
                    blocked.add(op, time.perf_counter() - start)
                return None
            work._work = _DelayedWork(work._work, ready)
            return work

        collectives._issue = slow_issue
        return self

    def __exit__(self, *exc_info: object) -> None:
        collectives._issue = self._issue
