"""`wall_clock_breakdown`: forward, backward, optimizer step and communication time.

Note [phases overlap communication]: "forward", "backward" and "step" are wall time
around the engine's calls, so they include the collectives issued inside them (a ZeRO-3
gather in the forward, gradient reductions in the backward). "comm" is the time spent
inside meshspeed.comm's collectives, from the same hook that feeds the comms logger
(comm/counter.py): for blocking calls it includes waiting for the slowest peer, which is
usually what a slow step is made of; for asynchronous calls only the launch. So comm is
a part of the other three, not a fourth slice to add to them.

On an accelerator each phase boundary synchronises the device, which costs some overlap
but makes the times belong to the phase that caused them (DeepSpeed's timers do the same).
"""

from __future__ import annotations

import contextlib
import time

import torch

from meshspeed.comm import counter

PHASES = ("forward", "backward", "step", "comm")


class StepTimers:
    """Seconds per phase: of the step in progress, of the last finished step, and summed
    over a window of steps (what the engine prints every `steps_per_print` steps)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device_type = torch.device(device or "cpu").type
        self.current = dict.fromkeys(PHASES, 0.0)
        self.last_step = dict.fromkeys(PHASES, 0.0)  # the last finished optimizer step
        self.window = dict.fromkeys(PHASES, 0.0)
        self.window_steps = 0
        self.attached = False

    def start(self) -> StepTimers:
        """Begin counting communication time (a sink on meshspeed.comm's counter)."""
        counter.attach(self)
        self.attached = True
        return self

    def stop(self) -> None:
        counter.detach(self)
        self.attached = False

    def on_collective(self, op: str, nbytes: int, seconds: float) -> None:
        self.current["comm"] += seconds  # called under counter.stats_lock

    def _sync(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def time(self, phase: str):
        """Add the wall time of the block to `phase` of the step in progress."""
        if phase not in PHASES[:3]:
            raise ValueError(f"StepTimers.time({phase!r}): expected one of {PHASES[:3]}")
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.current[phase] += time.perf_counter() - start

    def end_step(self) -> dict[str, float]:
        """Close the optimizer step in progress; returns its seconds per phase."""
        with counter.stats_lock:
            self.last_step, self.current = self.current, dict.fromkeys(PHASES, 0.0)
        for phase, seconds in self.last_step.items():
            self.window[phase] += seconds
        self.window_steps += 1
        return dict(self.last_step)

    def window_mean(self, reset: bool = True) -> dict[str, float]:
        """Mean seconds per step and phase since the last reset."""
        steps = max(self.window_steps, 1)
        mean = {phase: seconds / steps for phase, seconds in self.window.items()}
        if reset:
            self.window = dict.fromkeys(PHASES, 0.0)
            self.window_steps = 0
        return mean

    @staticmethod
    def format(mean: dict[str, float], steps: int) -> str:
        parts = " | ".join(f"{phase} {mean[phase] * 1e3:.2f}" for phase in PHASES)
        return f"time per step (ms, mean of {steps}): {parts} (comm is inside the other three)"
