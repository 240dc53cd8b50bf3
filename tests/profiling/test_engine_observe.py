"""The engine's `flops_profiler` step and `wall_clock_breakdown` timers, on 2 gloo ranks
(world size 2, data parallelism), and StepTimers alone."""

import logging
import os
import time

import pytest
import torch

from meshspeed.comm import counter
from meshspeed.profiling import StepTimers
from meshspeed.testing import run_distributed
from meshspeed.testing.engines import TINY, small_engine


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _observed_run(out_file):
    from meshspeed import comm

    log, lines = logging.getLogger("meshspeed"), _Lines()
    log.addHandler(lines)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        engine = small_engine(stage=0, wall_clock_breakdown=True, steps_per_print=2,
                              flops_profiler={"enabled": True, "profile_step": 1, "output_file": out_file})
        tokens = torch.randint(0, 16, (1, 4))
        last = []
        for _ in range(3):
            engine.backward(engine(tokens, tokens))
            engine.step()
            last.append(dict(engine.timers.last_step))
        engine.destroy()
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    return {"profile": engine.flops_profile, "last": last, "rank": comm.get_rank(),
            "timer_lines": [line for line in lines.lines if "time per step" in line]}


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    out = tmp_path_factory.mktemp("prof") / "flops.txt"
    return run_distributed(_observed_run, world_size=2, args=(str(out),)), out


def test_the_profiled_step_counts_forward_and_backward(observed):
    results, out = observed
    c, T = TINY, 4  # micro-batch 1 of 4 tokens per rank
    matmul_params = c.n_layer * (4 * c.d_model ** 2 + 3 * c.d_model * c.hidden_dim) + c.vocab_size * c.d_model
    forward = 2 * matmul_params * T + c.n_layer * 4 * T * T * c.d_model  # op_flops.py's convention
    for r in results:  # every rank profiles its own step
        assert r["profile"]["forward_flops"] == forward
        assert r["profile"]["flops"] == 3 * forward  # the backward is inside the profiled step
        assert r["profile"]["params"] == c.num_params()
    text = out.read_text()  # rank 0 alone writes it
    assert text.count("meshspeed flops profiler (step 1)") == 1 and "lm_head (Linear)" in text


def test_wall_clock_breakdown_times_each_phase_and_prints_every_steps_per_print(observed):
    results, _ = observed
    for r in results:
        for step in r["last"]:
            assert step["forward"] > 0 and step["backward"] > 0 and step["step"] > 0
            assert step["comm"] > 0  # data parallelism all-reduces gradients each step
    rank0, rank1 = results
    assert len(rank0["timer_lines"]) == 1 and "mean of 2" in rank0["timer_lines"][0]
    assert rank1["timer_lines"] == []


def _zero3_profile():
    engine = small_engine(stage=3, flops_profiler={"enabled": True, "profile_step": 0, "detailed": False,
                                                   "output_file": os.devnull})
    tokens = torch.randint(0, 16, (1, 4))
    engine.backward(engine(tokens, tokens))
    engine.step()
    engine.destroy()
    return engine.flops_profile


def test_zero3_profile_counts_whole_parameters_and_the_same_flops():
    """Stage 3 keeps empty placeholders between forwards: the parameter count reads the
    whole size (ds_numel), and the counted FLOPs do not change with sharding."""
    for profile in run_distributed(_zero3_profile, world_size=2):
        assert profile["params"] == TINY.num_params()
        assert profile["flops"] == 3 * profile["forward_flops"] > 0


def test_step_timers_sum_phases_and_collectives():
    timers = StepTimers().start()
    try:
        with timers.time("forward"):
            time.sleep(0.01)
        counter.record("all_reduce", 64, 0.25)  # what a collective reports
        counter.record("all_gather", 64, 0.5)
        first = timers.end_step()
        counter.record("all_reduce", 64, 1.0)
        second = timers.end_step()
    finally:
        timers.stop()
    counter.record("all_reduce", 64, 8.0)  # stopped: not counted
    assert first["forward"] >= 0.01 and first["comm"] == 0.75 and first["backward"] == 0.0
    assert second["comm"] == 1.0 and timers.current["comm"] == 0.0
    assert timers.window_mean() == pytest.approx({"forward": first["forward"] / 2, "backward": 0.0,
                                                  "step": 0.0, "comm": 0.875})
    assert timers.window_steps == 0  # reset by window_mean
    with pytest.raises(ValueError, match="expected one of"), timers.time("comm"):
        pass
