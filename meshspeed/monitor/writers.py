"""Where monitor events go: CSV files, TensorBoard, Weights & Biases.

An event is `(name, value, step)` with DeepSpeed's names ("Train/Samples/train_loss")
and, as in DeepSpeed, the step is the number of samples trained so far. Each writer is
built on rank 0 only (`meshspeed.monitor.monitor.Monitor` decides); the optional packages
are checked on every rank first (`require`) so that a missing one stops the whole job at
initialize with the same message, instead of rank 0 alone failing and the others hanging.
"""

from __future__ import annotations

import csv
import importlib.util
import os
from collections.abc import Iterable

Event = tuple[str, float, int]


def require(package: str, block: str) -> None:
    """Raise ImportError naming `package` when it is not installed."""
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"the `{block}` config block is enabled but the `{package}` package is not "
                          f"installed; pip install {package}, or set {block}.enabled to false")


def _job_dir(output_path: str, job_name: str) -> str:
    return os.path.join(output_path or os.getcwd(), job_name)


class CsvWriter:
    """One CSV file per event name, `<output_path>/<job_name>/<name with / as _>.csv`,
    with the header `step,<name>` and one row per write (appended and flushed at once,
    so a job that dies keeps every row up to its last step)."""

    def __init__(self, output_path: str, job_name: str) -> None:
        self.dir = _job_dir(output_path, job_name)
        os.makedirs(self.dir, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name.replace("/", "_") + ".csv")

    def write_events(self, events: Iterable[Event]) -> None:
        for name, value, step in events:
            path = self.path(name)
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                out = csv.writer(f)
                if new:
                    out.writerow(["step", name])
                out.writerow([step, repr(float(value))])

    def close(self) -> None:
        pass


class TensorBoardWriter:
    """Scalars in `<output_path>/<job_name>/` through torch.utils.tensorboard."""

    def __init__(self, output_path: str, job_name: str) -> None:
        require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter  # lazy: optional dependency (tensorboard)

        self.dir = _job_dir(output_path, job_name)
        self.writer = SummaryWriter(log_dir=self.dir)

    def write_events(self, events: Iterable[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """wandb.log of each step's events, in a run of `project` (entity `team`, `group`)."""

    def __init__(self, project: str, team: str | None, group: str | None) -> None:
        require("wandb", "wandb")
        import wandb  # lazy: optional dependency (wandb)

        self.wandb = wandb
        self.run = wandb.init(project=project, entity=team, group=group)

    def write_events(self, events: Iterable[Event]) -> None:
        events = list(events)
        if events:
            self.run.log({name: value for name, value, _ in events}, step=events[0][2])

    def close(self) -> None:
        self.run.finish()
