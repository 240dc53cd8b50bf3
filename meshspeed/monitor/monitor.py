"""`Monitor`: the enabled writers of a config, fed the same events, on rank 0."""

from __future__ import annotations

from collections.abc import Iterable

from meshspeed.monitor.writers import CsvWriter, Event, TensorBoardWriter, WandbWriter, require


class Monitor:
    """Writes each batch of events to every enabled writer (DeepSpeed's MonitorMaster).

    `enabled` is true when any block is on; then the engine collects the step's figures
    on every rank (the memory figures are gathered to rank 0), and only rank 0 writes."""

    def __init__(self, config, rank: int) -> None:
        tb, csv_cfg, wb = config.tensorboard, config.csv_monitor, config.wandb
        # checked on every rank: Note in writers.py
        if tb.enabled:
            require("tensorboard", "tensorboard")
        if wb.enabled:
            require("wandb", "wandb")
        self.enabled = tb.enabled or csv_cfg.enabled or wb.enabled
        self.writers: list = []
        if rank != 0:
            return
        if csv_cfg.enabled:
            self.writers.append(CsvWriter(csv_cfg.output_path, csv_cfg.job_name))
        if tb.enabled:
            self.writers.append(TensorBoardWriter(tb.output_path, tb.job_name))
        if wb.enabled:
            self.writers.append(WandbWriter(wb.project, wb.team, wb.group))

    def write_events(self, events: Iterable[Event]) -> None:
        events = list(events)
        for writer in self.writers:
            writer.write_events(events)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers.clear()
