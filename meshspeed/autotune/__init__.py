"""Measure the planner's best layouts on this machine and keep the fastest:
`meshspeed autotune` and DeepSpeed's `autotuning` block (docs/autotune.md)."""

from meshspeed.autotune.report import Trial
from meshspeed.autotune.trial import TuneError


def autotune(*args, **kwargs):
    # imported on use: meshspeed.engine imports autotune.hooks, and the tuner imports the
    # planner and config loader, which a training process does not need
    from meshspeed.autotune.tuner import autotune as run

    return run(*args, **kwargs)


__all__ = ["Trial", "TuneError", "autotune"]
