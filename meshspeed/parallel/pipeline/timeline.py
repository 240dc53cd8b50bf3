"""What each stage executed, when: spans, the bubble they leave, and a JSON form of them.

    spans = []
    run_stage(..., timeline=spans)                  # one Span per executed action
    bubble_fraction(all_stages_spans)                 # 0.2: a fifth of the stage-time idle
    json.dumps(to_json(all_stages_spans))             # for `pipeline-plot` and benchmarks

`spans_per_stage` is a list with one list of spans per stage. Times are
`time.perf_counter()` seconds, which on Linux is one clock for every process of a machine
(CLOCK_MONOTONIC); spans gathered from several machines are only comparable after their
clocks are aligned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Span(NamedTuple):
    """One executed action: its kind ("F", "B", "I", "W"), micro-batch, chunk, and times."""

    kind: str
    micro: int
    chunk: int
    start: float
    end: float


def _bounds(spans_per_stage: Sequence[Sequence[Span]]) -> tuple[float, float]:
    every = [s for row in spans_per_stage for s in row]
    if not every:
        raise ValueError("a timeline needs at least one span, got none")
    return min(s.start for s in every), max(s.end for s in every)


def bubble_fraction(spans_per_stage: Sequence[Sequence[Span]]) -> float:
    """The idle share of the stage-time from the earliest start to the latest end over all
    stages: 1 - (sum of span lengths) / (stages * (latest end - earliest start)). Spans of
    one stage must not overlap (those `run_stage` records do not)."""
    start, end = _bounds(spans_per_stage)
    if end <= start:
        raise ValueError(f"a timeline must last some time, got spans from {start} to {end}")
    busy = sum(s.end - s.start for row in spans_per_stage for s in row)
    return 1 - busy / (len(spans_per_stage) * (end - start))


def to_json(spans_per_stage: Sequence[Sequence[Span]]) -> list[list[dict]]:
    """Per stage, a list of {kind, micro, chunk, start, end}, times relative to the earliest
    start of all stages."""
    origin = _bounds(spans_per_stage)[0]
    return [[{"kind": s.kind, "micro": s.micro, "chunk": s.chunk, "start": s.start - origin,
              "end": s.end - origin} for s in row] for row in spans_per_stage]


def from_json(data: Sequence[Sequence[dict]]) -> list[list[Span]]:
    """The inverse of `to_json` (times stay relative to the earliest start)."""
    try:
        return [[Span(str(d["kind"]), int(d["micro"]), int(d["chunk"]), float(d["start"]), float(d["end"]))
                 for d in row] for row in data]
    except (KeyError, TypeError) as err:
        raise ValueError(f"a timeline in JSON is a list per stage of objects with kind, micro, chunk, "
                         f"start and end; this one is not ({type(err).__name__}: {err})") from None


def from_simulation(spans) -> list[list[Span]]:
    """Spans from `schedule.simulate(...).spans` (per stage, (Action, start, end)), to put a
    planned timeline beside a measured one."""
    return [[Span(a.kind, a.micro, a.chunk, start, end) for a, start, end in row] for row in spans]
