"""What a training process does for the autotuner, told by environment variables (the
tuner starts the user's unchanged script; these are its only way in).

* PROBE_ENV=<file>: `initialize` writes the model's facts (parameter count and its config:
  layers, d_model, heads, vocab) to <file>; the first forward adds the batch's sequence
  length, and the process exits 0 there, having trained nothing.
* METRICS_ENV=<file prefix>, STEPS_ENV="start,end": after optimizer step `end` every rank
  writes `<prefix>.rank<r>.json` (seconds per step over steps start..end, samples/s,
  peak memory) and the job exits 0.

Both hooks are one call each from meshspeed/engine (build.py and observe.py) and cost
nothing when the variables are unset.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from meshspeed import comm

PROBE_ENV = "MESHSPEED_AUTOTUNE_PROBE"
METRICS_ENV = "MESHSPEED_AUTOTUNE_METRICS"
STEPS_ENV = "MESHSPEED_AUTOTUNE_STEPS"


def _model_config(model: torch.nn.Module) -> dict[str, Any] | None:
    """The model's shape as a dict the planner reads (meshspeed GPTConfig or a Hugging Face
    config), or None when the model carries no config."""
    cfg = getattr(model, "config", None)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {k: v for k, v in dataclasses.asdict(cfg).items() if v is None or isinstance(v, (int, float, str, bool))}
    if hasattr(cfg, "to_dict"):
        return {k: v for k, v in cfg.to_dict().items() if v is None or isinstance(v, (int, float, str, bool))}
    return None


def _exit_now() -> None:
    # os._exit, not SystemExit: a script may catch exceptions around its loop, and no
    # atexit work (process-group teardown, writers) is wanted from a measurement run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Probe:
    """Writes the model's facts at initialize and the sequence length at the first forward."""

    def __init__(self, path: str, model: torch.nn.Module) -> None:
        self.path = Path(path)
        self.facts: dict[str, Any] = {
            "num_params": sum(p.numel() for p in model.parameters()),
            "model_config": _model_config(model),
            "model_class": type(model).__name__,
            "seq_len": None,
        }
        self._write()

    def _write(self) -> None:
        self.path.write_text(json.dumps(self.facts, indent=2) + "\n")

    def watch(self, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(self._on_forward, with_kwargs=True)

    def _on_forward(self, _module, args, kwargs) -> None:
        batch = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() >= 2]
        if batch:  # (batch, sequence, ...): tokens or embeddings
            self.facts["seq_len"] = int(batch[0].shape[1])
            self.facts["micro_batch"] = int(batch[0].shape[0])
        self._write()
        _exit_now()


def start_probe(model: torch.nn.Module) -> Probe | None:
    """Called by initialize before anything is built; None unless the tuner asked."""
    path = os.environ.get(PROBE_ENV)
    return Probe(path, model) if path else None


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


class StepClock:
    """Times optimizer steps start..end of a trial, writes the figures, ends the job."""

    def __init__(self, prefix: str, start: int, end: int) -> None:
        if not 0 < start < end:
            raise ValueError(f"{STEPS_ENV} must be 'start,end' with 0 < start < end, got {start},{end}")
        self.prefix, self.start, self.end = prefix, start, end
        self.t0: float | None = None

    def after_step(self, engine) -> None:
        step = engine.global_steps
        if step == self.start:
            self._sync(engine)
            self.t0 = self.last = time.perf_counter()
            self.times: list[float] = []  # each timed step: the tuner's measure of noise
        elif self.t0 is not None and self.start < step <= self.end:
            self._sync(engine)
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now
        if step == self.end and self.t0 is not None:
            seconds = (self.last - self.t0) / (self.end - self.start)
            rank = comm.get_rank() if comm.is_initialized() else 0
            figures = {"rank": rank, "step_seconds": seconds,
                       "samples_per_second": engine.config.train_batch_size / seconds,
                       "train_batch_size": engine.config.train_batch_size,
                       "peak_memory_bytes": _peak_bytes(engine.device),
                       "steps": [self.start, self.end], "step_times": self.times}
            Path(f"{self.prefix}.rank{rank}.json").write_text(json.dumps(figures) + "\n")
            if comm.is_initialized():
                comm.barrier()  # every rank has finished the step and written: nobody waits on us
            _exit_now()

    @staticmethod
    def _sync(engine) -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)


def step_clock_from_env() -> StepClock | None:
    prefix = os.environ.get(METRICS_ENV)
    if not prefix:
        return None
    try:
        start, end = (int(x) for x in os.environ.get(STEPS_ENV, "3,5").split(","))
    except ValueError:
        raise ValueError(f"{STEPS_ENV} must be two step numbers 'start,end', "
                         f"got {os.environ.get(STEPS_ENV)!r}") from None
    return StepClock(prefix, start, end)
