"""Monitors: per-step training figures written to CSV, TensorBoard or Weights & Biases.

monitor.py     Monitor: the writers the config enables, on rank 0
writers.py     CsvWriter, TensorBoardWriter, WandbWriter (the last two need their packages)
step_events.py the figures of one optimizer step as DeepSpeed-named events

The engine feeds them after every optimizer step (meshspeed/engine/observe.py);
docs/observability.md lists the events.
"""

from meshspeed.monitor.monitor import Monitor
from meshspeed.monitor.writers import CsvWriter, TensorBoardWriter, WandbWriter

__all__ = ["CsvWriter", "Monitor", "TensorBoardWriter", "WandbWriter"]
