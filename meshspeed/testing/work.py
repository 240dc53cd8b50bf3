"""Work per optimizer step, counted in deterministic units: the guard against the step
growing slower that does not depend on a clock (tests/engine/test_work_counts.py, and
benchmarks/step_work.py for profiles and other commits).

Note [work counts]
Wall-clock time on a shared 2-core machine moves by 20% between runs; counts do not. For
one optimizer step of an engine (forward, backward and step of each micro-batch) on this
rank, after warm-up steps, `count_step_work` measures:
- `python_calls`: Python function calls made in meshspeed's own code (sys.setprofile
  "call" events whose code lives under meshspeed/), the interpreter work the library adds
  around torch; `torch_calls` the same for torch's Python code (nn.Module machinery,
  autograd Functions, hooks), which meshspeed's choices also drive;
- `collectives` and `bytes`: calls and ring bytes of every collective (CommCounter), the
  agreement's and the hang reports' included;
- `allocations`: tensor allocations on the CPU (torch profiler memory events with
  positive size), the allocator traffic a step makes.
Every protection stays on: the step agreement, the collective digest and call sites.
The counts are the same on every run of the same code, torch and Python, so a test can
hold them to a committed baseline.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from meshspeed import comm

_MESHSPEED = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def count_python_calls(fn: Callable[[], Any]) -> tuple[int, int, Any]:
    """(calls in meshspeed's code, calls in torch's Python code, fn's result)."""
    counts = {"meshspeed": 0, "torch": 0}

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(_MESHSPEED):
                counts["meshspeed"] += 1
            elif path.startswith(_TORCH):
                counts["torch"] += 1

    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return counts["meshspeed"], counts["torch"], result


def count_allocations(fn: Callable[[], Any]) -> int:
    """CPU tensor allocations `fn` makes (torch profiler memory events of positive size)."""
    from torch.profiler import ProfilerActivity, profile  # lazy: start-up cost (the profiler)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(1 for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0)


def count_step_work(step: Callable[[], Any], warmup: int = 2) -> dict[str, int]:
    """Note [work counts] for one optimizer step: `step()` runs one (every micro-batch's
    forward and backward, and the optimizer step, or a pipelined `train_batch`); it runs
    `warmup` times first."""
    for _ in range(warmup):
        step()
    # A garbage collection inside a counted step runs finalizers (Python calls) at a moment
    # that depends on everything the process did before: collect first, none while counting.
    gc.collect()
    gc.disable()
    try:
        meshspeed_calls, torch_calls, _ = count_python_calls(step)
        with comm.CommCounter() as counter:
            step()
        allocations = count_allocations(step)
    finally:
        gc.enable()
    summary = counter.summary()
    return {"python_calls": meshspeed_calls, "torch_calls": torch_calls,
            "collectives": sum(v["calls"] for v in summary.values()),
            "bytes": sum(v["bytes"] for v in summary.values()), "allocations": allocations}


def engine_step(engine, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    """One optimizer step of a (non-pipelined) engine over `batches`, its micro-batches."""
    def step():
        for x, y in batches:
            engine.backward(engine(x, y))
            engine.step()
    return step
