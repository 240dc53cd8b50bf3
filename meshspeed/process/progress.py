"""Progress of long work, on rank 0: a tqdm bar on a terminal, a few plain lines in a log.

    with progress(len(files), "checkpoint save", unit="file") as bar:
        for f in files:
            write(f)
            bar.update()

Note [progress only for long work]
Short work says nothing: a bar appears only after `delay` seconds (2 by default), and the
plain lines (for a stdout that is not a terminal: a log file, a pipe, a CI job) start
only then too: one line when the work turns out long (unless a quarter is passed right
then), one per quarter passed after that, and a last one with the elapsed time, through the "meshspeed" logger, so a program's
logging set-up applies and MESHSPEED_LOG_LEVEL=warning (or the config's log_level)
quiets them as it quiets the banner. tqdm's own redraws never reach a file. Ranks other
than 0, and any rank while the logger does not show INFO lines, get a silent tracker.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm
from typing_extensions import Self

from meshspeed.process import speak

QUARTERS = (25, 50, 75)


class Progress:
    """Counts `update(n)` calls against `total`; `close()` (or the `with` block) ends it."""

    def __init__(self, total: int, desc: str, unit: str = "item", delay: float = 2.0,
                 show: bool = True, tty: bool | None = None) -> None:
        self.total, self.desc, self.unit, self.delay = max(int(total), 0), desc, unit, delay
        self.done = 0
        self.started = time.perf_counter()
        self.show = show
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.bar = None
        if show and self.tty:
            self.bar = tqdm(total=self.total, desc=desc, unit=unit, delay=delay, file=sys.stdout,
                            dynamic_ncols=True, leave=False)
        self._said = False  # a plain line was written: the work is long
        self._quarter = 0  # plain lines: the last quarter reported

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.show:
            self._plain()

    def _plain(self) -> None:
        elapsed = time.perf_counter() - self.started
        if elapsed < self.delay or self.done >= self.total:
            return
        percent = 100 * self.done // max(self.total, 1)
        passed = [q for q in QUARTERS if self._quarter < q <= percent]
        if passed:  # the first quarter passed after the delay, then each next one
            self._quarter = passed[-1]
            speak.log.info("%s: %d%% (%d of %d %ss) after %.1f s", self.desc, percent, self.done,
                           self.total, self.unit, elapsed)
        elif not self._said:  # the work just turned out long
            speak.log.info("%s: %d of %d %ss after %.1f s ...", self.desc, self.done, self.total, self.unit,
                           elapsed)
        self._said = True

    def write(self, line: str) -> None:
        """Print `line` to stdout (above the bar, on a terminal)."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        elapsed = time.perf_counter() - self.started
        if self.bar is not None:
            self.bar.close()
            if elapsed >= self.delay:  # the bar was shown: leave one line in its place
                speak.log.info("%s: done, %d %ss in %.1f s", self.desc, self.done, self.unit, elapsed)
        elif self.show and (self._said or elapsed >= self.delay):
            speak.log.info("%s: done, %d %ss in %.1f s", self.desc, self.done, self.unit, elapsed)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: int, desc: str, unit: str = "item", delay: float = 2.0) -> Progress:
    """A Progress for `total` units of `desc` (Note [progress only for long work]); silent
    on ranks other than 0. Sets up meshspeed's own handler first if the program configured
    no logging (Note [meshspeed's own handler]), so work before `initialize` (a zero.Init
    build, a checkpoint conversion) reports too."""
    show = speak.rank() == 0
    if show:
        speak.speak_default()
        show = speak.speaks_info()
    return Progress(total, desc, unit=unit, delay=delay, show=show)
