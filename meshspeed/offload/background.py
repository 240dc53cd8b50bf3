"""What the background updates of an offloaded optimizer run on (Note [the update during
the backward] and Note [the update that runs into the next forward] in optimizer.py):

- `SerialRunner`: one thread that runs the submitted updates in order; what has not
  started can be taken back (step() reorders it for the next forward);
- `Handoff`: the updated 16-bit values, from that thread to the one that owns the shard
  store, bounded;
- `Pace`: how much of the updates the next forward can take, from the last forward's
  seconds and the disk's throughput.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from meshspeed.offload.aio import io_totals


class SerialRunner:
    """One background thread that runs what is submitted in order, without waiting for
    what runs before (Note [the update during the backward]); `wait` joins all of it."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshspeed-offload-early")
        self._futures: list[tuple[Future, tuple]] = []

    def submit(self, fn, *args) -> None:
        self._futures.append((self._pool.submit(fn, *args), args))

    def take_back(self) -> list[tuple]:
        """The arguments of what was submitted and has not started, which now never will."""
        kept, back = [], []
        for f, args in self._futures:
            (back if f.cancel() else kept).append((f, args))
        self._futures = kept
        return [args for _, args in back]

    def idle(self) -> bool:
        """Nothing submitted is still to run (errors are raised by `check` and `wait`)."""
        return all(f.done() for f, _ in self._futures)

    def check(self) -> None:
        """Re-raise the error of a submission that failed, if any."""
        for f, _ in self._futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                self._futures = []
                raise f.exception()

    def wait(self, between=None) -> None:
        """Join everything submitted, re-raising the first error; `between()` runs every
        50 ms meanwhile (the publishes the background thread hands over)."""
        futures, self._futures = [f for f, _ in self._futures], []
        for f in futures:
            while True:
                try:
                    f.result(timeout=0.05)
                    break
                except FutureTimeout:
                    if between is not None:
                        between()

    def close(self, between=None) -> None:
        try:
            self.wait(between)
        finally:
            self._pool.shutdown(wait=True)


class Handoff:
    """(master, 16-bit values) from the background update to the backward's thread, which
    publishes them (Note [the update during the backward]); at most `limit` bytes wait,
    beyond one item: the background thread waits for the next `drain`."""

    def __init__(self, limit: int):
        self.limit = limit
        self._items: deque = deque()
        self._bytes = 0
        self._cv = threading.Condition()

    def put(self, master: torch.Tensor, values: torch.Tensor) -> None:
        with self._cv:
            while self._items and self._bytes + values.nbytes > self.limit:
                self._cv.wait()
            self._items.append((master, values))
            self._bytes += values.nbytes

    def drain(self, publish) -> None:
        while True:
            with self._cv:
                if not self._items:
                    return
                master, values = self._items.popleft()
            publish(master, values)
            with self._cv:
                self._bytes -= values.nbytes
                self._cv.notify_all()


# bytes a sub-group's update moves per element: fp32 master and two moments read and
# written (24), a 16-bit gradient read (2)
UPDATE_BYTES = 26


class Pace:
    """The last step's first forward in seconds (its first gather to the first gather of a
    unit gathered before, the backward's), and the disk's throughput over the last step
    (bytes per second with a request in flight): what the next forward can take of the
    updates (Note [the update that runs into the next forward])."""

    share = 0.5  # of the forward's seconds, for the updates it takes (the rest: its own reads)

    def __init__(self):
        self._t_gather: float | None = None
        self._waited = 0.0  # of the forward timed, in waits for the updates it took
        self.forward_s = 0.0
        self._last: dict | None = None
        self.rate = 0.0

    def gathered(self, again: bool) -> None:
        """A unit is gathered; `again`: the step gathered it before."""
        if not again:
            if self._t_gather is None:
                self._t_gather, self._waited = time.perf_counter(), 0.0
            return
        if self._t_gather is not None:
            self.forward_s = time.perf_counter() - self._t_gather - self._waited
            self._t_gather = None
            now = io_totals()
            if self._last is not None:
                busy = now["busy_s"] - self._last["busy_s"]
                moved = now["read"] + now["write"] - self._last["read"] - self._last["write"]
                self.rate = moved / busy if busy > 0 else 0.0
            self._last = now

    def waited(self, seconds: float) -> None:
        self._waited += seconds

    def budget(self) -> float:
        """Bytes of updates the next forward can take."""
        return self.share * self.forward_s * self.rate
