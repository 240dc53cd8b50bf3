"""What the engine reports about its own steps: `wall_clock_breakdown`, the
`flops_profiler` step and the monitors (`tensorboard`, `csv_monitor`, `wandb`).

The engine calls four points: `phase(...)` around its forward, backward and optimizer
step, `on_loss(loss)`, `after_step()` once per optimizer step, and `close()`; the
pipeline engine, which runs its schedule itself, calls `begin_batch` and `on_loss`
around it (its forward and backward are not timed apart). With
every block off each is a no-op, so an unobserved run pays nothing.
"""

from __future__ import annotations

import contextlib
import logging
import time

from meshspeed import comm
from meshspeed.monitor.autotune_hooks import step_clock_from_env
from meshspeed.monitor.monitor import Monitor
from meshspeed.monitor.step_events import StepFigures, count_tokens
from meshspeed.profiling.flops_profiler import FlopsProfiler
from meshspeed.profiling.timers import StepTimers

log = logging.getLogger("meshspeed")


def _rank() -> int:
    return comm.get_rank() if comm.is_initialized() else 0


class StepObserver:
    def __init__(self, engine) -> None:
        cfg = engine.config
        self.engine = engine
        self.timers = StepTimers(engine.device).start() if cfg.wall_clock_breakdown else None
        self.monitor = Monitor(cfg, _rank())
        self.figures = StepFigures() if self.monitor.enabled else None
        self.flops = cfg.flops_profiler if cfg.flops_profiler.enabled else None
        self.profiler: FlopsProfiler | None = None
        self.last_profile: str | None = None  # rank 0: the printed profile
        self.profile_figures: dict | None = None  # every rank: totals of the profiled step
        self.clock = step_clock_from_env()  # an autotuner trial's timed steps (monitor/autotune_hooks.py)
        self.window = StepWindow()  # the steps_per_print line's throughput and step time

    @contextlib.contextmanager
    def phase(self, name: str, inputs: tuple = ()):
        """Time `name` ("forward", "backward", "step"); a forward also starts the profiler
        on the profiled step and counts the batch's tokens."""
        if name == "forward":
            self._before_forward(inputs)
        if self.timers is None:
            yield
            return
        with self.timers.time(name):
            yield

    def _before_forward(self, inputs: tuple) -> None:
        engine = self.engine
        self.window.on_forward(inputs, engine)
        if self.figures is not None:
            self.figures.on_forward(inputs, engine.global_samples)
        if self.flops is not None and self.profiler is None and engine.global_steps == self.flops.profile_step:
            self.profiler = FlopsProfiler(engine.module)
            self.profiler.start_profile()

    def begin_batch(self, micro_batches) -> None:
        """The pipeline engine's train_batch, before its schedule runs: the batch's
        micro-batch inputs (None on stages that read none)."""
        first, *rest = list(micro_batches or [()])
        self._before_forward(first if isinstance(first, tuple) else (first,))
        for mb in rest:
            tokens = count_tokens(mb if isinstance(mb, tuple) else (mb,))
            self.window.tokens += tokens
            if self.figures is not None:
                self.figures.tokens += tokens

    def on_loss(self, loss) -> None:
        """A micro-step's loss (or the pipeline's mean loss of a batch)."""
        if self.figures is not None:
            self.figures.on_backward(loss)

    def after_step(self) -> None:
        """Once per optimizer step, after global_steps has moved on."""
        engine, rank = self.engine, _rank()
        if self.profiler is not None and self.profiler.started:
            self._finish_profile(rank)
        if self.timers is not None:
            self.timers.end_step()
            every = engine.config.steps_per_print
            if engine.global_steps % every == 0:
                steps = self.timers.window_steps
                mean = self.timers.window_mean()
                if rank == 0:
                    log.info("step %d: %s", engine.global_steps, StepTimers.format(mean, steps))
        if self.figures is not None:
            events = self.figures.events(engine)  # every rank: gathers the memory figures
            self.monitor.write_events(events)  # rank 0's writers; none on other ranks
        if self.clock is not None:
            self.clock.after_step(engine)

    def _finish_profile(self, rank: int) -> None:
        prof, cfg = self.profiler, self.flops
        prof.stop_profile()
        if rank == 0:
            text = prof.print_model_profile(profile_step=cfg.profile_step, module_depth=cfg.module_depth,
                                            top_modules=cfg.top_modules, detailed=cfg.detailed,
                                            output_file=cfg.output_file)
            self.last_profile = text
        self.profile_figures = {"flops": prof.get_total_flops(), "forward_flops": 2 * prof.forward_macs(),
                                "params": prof.get_total_params(), "forward_seconds": prof.get_total_duration()}
        prof.end_profile()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop_profile()
        if self.timers is not None:
            self.timers.stop()
        self.monitor.close()


class StepWindow:
    """Tokens, samples, steps and wall time since the last `steps_per_print` line (from
    the first forward, so the build is not counted)."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.tokens = 0
        self.samples_at = self.steps_at = 0

    def on_forward(self, inputs: tuple, engine) -> None:
        if self.started is None:
            self.started = time.perf_counter()
            self.samples_at, self.steps_at = engine.global_samples, engine.global_steps
        self.tokens += count_tokens(inputs)

    def take(self, engine) -> dict:
        """The window's figures (tokens over every data-parallel rank, as the monitors
        count them), and a new window from now."""
        now = time.perf_counter()
        out = {"seconds": now - self.started if self.started is not None else 0.0,
               "steps": engine.global_steps - self.steps_at,
               "samples": engine.global_samples - self.samples_at,
               "tokens": self.tokens * engine.topology.size("dp")}
        self.started, self.tokens = now, 0
        self.samples_at, self.steps_at = engine.global_samples, engine.global_steps
        return out
