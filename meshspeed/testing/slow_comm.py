"""`SlowLink`: make every asynchronous collective take at least `delay` seconds.

    with SlowLink(0.01):
        ...   # a work launched at t completes no earlier than t + 0.01 for its caller

The delay runs from the launch, as on a slow link: time the caller spends computing
before `wait()` hides it, which is what overlapping communication is for. Tests use it
to show results do not depend on when communication completes, and that
`comm.BlockedTimer` sees the exposed part. Synchronous collectives are not delayed.
Patches `meshspeed.comm.collectives` for the duration of the block (test use only).
"""

from __future__ import annotations

import time
from typing import Any

from typing_extensions import Self

from meshspeed.comm import collectives


class _DelayedWork:
    def __init__(self, work: Any, ready_at: float) -> None:
        self._work, self._ready_at = work, ready_at

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        left = self._ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return time.perf_counter() >= self._ready_at and self._work.is_completed()


class SlowLink:
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self._init: Any = None

    def __enter__(self) -> Self:
        self._init = init = collectives._TimedWork.__init__
        delay = self.delay

        def delayed_init(timed: Any, work: Any, *args: Any, **kwargs: Any) -> None:
            init(timed, _DelayedWork(work, time.perf_counter() + delay), *args, **kwargs)

        collectives._TimedWork.__init__ = delayed_init
        return self

    def __exit__(self, *exc_info: object) -> None:
        collectives._TimedWork.__init__ = self._init
