"""Progress of long work (issue 32): in a log (stdout not a terminal) a few plain lines,
and only for work that takes longer than the delay; nothing from tqdm's redraws
(Note [progress only for long work], meshspeed/process/progress.py)."""

from __future__ import annotations

import logging

import pytest

from meshspeed.process import progress as progress_module
from meshspeed.process.progress import Progress, progress


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", fake)
    return fake


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "meshspeed"]


def test_long_work_in_a_log_gives_a_few_plain_lines(clock, caplog, capsys):
    caplog.set_level(logging.INFO, logger="meshspeed")
    with Progress(1000, "checkpoint save", unit="tensor", tty=False) as bar:
        for _ in range(1000):
            clock.now += 0.01  # 10 s in all
            bar.update()
    assert _lines(caplog) == [
        "checkpoint save: 200 of 1000 tensors after 2.0 s ...",
        "checkpoint save: 25% (250 of 1000 tensors) after 2.5 s",
        "checkpoint save: 50% (500 of 1000 tensors) after 5.0 s",
        "checkpoint save: 75% (750 of 1000 tensors) after 7.5 s",
        "checkpoint save: done, 1000 tensors in 10.0 s",
    ]
    out = capsys.readouterr()
    assert "\r" not in out.out + out.err  # no bar redraws in a file


def test_short_work_says_nothing(clock, caplog, capsys):
    caplog.set_level(logging.INFO, logger="meshspeed")
    with Progress(1000, "checkpoint load", tty=False) as bar:
        for _ in range(1000):
            clock.now += 0.001  # 1 s, under the 2 s delay
            bar.update()
    assert _lines(caplog) == []
    assert capsys.readouterr().out == ""


def test_other_ranks_and_a_quiet_logger_report_nothing(clock, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="meshspeed")  # as MESHSPEED_LOG_LEVEL=warning leaves it
    assert not progress(10, "NVMe swap files").show
    caplog.set_level(logging.INFO, logger="meshspeed")
    assert progress(10, "NVMe swap files").show
    monkeypatch.setenv("RANK", "1")
    # from RANK, even where an earlier in-process test left a process group (rank 0)
    monkeypatch.setattr(progress_module.speak.comm, "is_initialized", lambda: False)
    assert not progress(10, "NVMe swap files").show
