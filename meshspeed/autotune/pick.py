"""Which measured trial is kept, and whether the measurements can tell the top ones apart.

A trial times a few optimizer steps; on a shared or small machine two layouts a few
percent apart can swap places from one run to the next. So a trial's noise is the range
of its single step times (rank 0's, StepClock), and two trials are within noise of each
other when those ranges overlap. When the trial that scores best on the metric is within
noise of others, none of them is faster by the evidence: the one that needs the fewest
bytes (the planner's prediction, which does not vary from run to run) is kept, then the
simpler layout (the shorter label: fewer degrees and options), and the report says so
instead of naming a winner.
"""

from __future__ import annotations

from meshspeed.autotune.report import Trial


def step_range(t: Trial) -> tuple[float, float] | None:
    """(fastest, slowest) single step of `t`, or None with fewer than two timed steps."""
    return (min(t.step_times), max(t.step_times)) if len(t.step_times) >= 2 else None


def within_noise(a: Trial, b: Trial) -> bool:
    ra, rb = step_range(a), step_range(b)
    return ra is not None and rb is not None and ra[0] <= rb[1] and rb[0] <= ra[1]


def describe(t: Trial, number: int) -> str:
    r = step_range(t)
    spread = f", steps {r[0]:.3g}-{r[1]:.3g} s" if r else ""
    return f"trial {number} {t.layout} ({t.step_seconds:.3g} s/step{spread})"


def pick(trials: list[Trial], metric: str) -> tuple[Trial | None, str]:
    """(the trial kept, a sentence when the top trials are within noise, else "")."""
    ok = [t for t in trials if t.status == "ok" and t.score(metric) is not None]
    if not ok:
        return None, ""
    top = max(ok, key=lambda t: t.score(metric))
    tied = [top, *(t for t in ok if t is not top and within_noise(t, top))]
    if len(tied) == 1:
        return top, ""
    kept = min(tied, key=lambda t: (t.predicted_memory_bytes, len(t.layout), -t.score(metric)))
    number = {id(t): i + 1 for i, t in enumerate(trials)}
    names = "; ".join(describe(t, number[id(t)]) for t in tied)
    others = [t for t in tied if t is not kept]
    if kept.predicted_memory_bytes < min(t.predicted_memory_bytes for t in others):
        why = (f"it needs the fewest bytes ({kept.predicted_memory_bytes / 2**20:.0f} MB predicted per rank, "
               f"against {min(t.predicted_memory_bytes for t in others) / 2**20:.0f} MB)")
    else:
        why = "it needs no more bytes and is the simplest layout"
    top_note = "" if kept is top else f"; trial {number[id(top)]} scored best by {metric}, by less than the noise"
    return kept, (f"within noise of each other (their single-step times overlap): {names}; "
                  f"picked trial {number[id(kept)]} {kept.layout} because {why}{top_note}")
