"""Measure the planner's best layouts on this machine and keep the fastest:
`meshspeed autotune` and DeepSpeed's `autotuning` block (docs/autotune.md)."""

from meshspeed.autotune.report import Trial
from meshspeed.autotune.trial import TuneError
from meshspeed.autotune.tuner import autotune as run


def autotune(*args, **kwargs):
    # lazy: start-up cost; the tuner imports the planner and config loader, which
    # `meshspeed run` (importing TuneError from here) does not need
    return run(*args, **kwargs)


__all__ = ["Trial", "TuneError", "autotune"]
