"""Pipeline schedules as data (meshspeed/parallel/pipeline/schedule.py): every micro-batch
forwarded and backwarded once per (virtual) stage, dependencies satisfiable (the
simulation never deadlocks), peak in-flight activations at each schedule's bound, and a
simulated bubble equal to the formula of Note [schedules and their bounds]."""

import pytest

from meshspeed.parallel.pipeline.schedule import (
    Action,
    ScheduleError,
    build,
    check,
    format_schedule,
    forward_only,
    fuse_adjacent_halves,
    one_f_one_b,
    simulate,
)

SIZES = [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16)]  # (stages, micro-batches)


def _bubble(name, p, m, v=1):
    return {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1),
            "interleaved": (p - 1) / (v * m + p - 1), "zb-h1": (p - 1) / (3 * m + p - 1)}[name]


def _peak(name, p, m, s, v=1):
    return {"gpipe": m, "1f1b": min(p - s, m), "zb-h1": min(p, m),
            "interleaved": min((p - s - 1) * 2 + (v - 1) * p + 1, v * m)}[name]


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1)])
@pytest.mark.parametrize("p,m", SIZES)
def test_schedule_is_complete_has_its_bubble_and_its_memory_bound(name, v, p, m):
    schedule = build(name, m, p, v)
    check(schedule, m, v)
    # t_F = 1, a whole backward 2 (for ZB-H1: its input half 1, its weight half 1)
    timeline = simulate(schedule, t_forward=1.0, t_backward=2.0,
                        t_weight=1.0 if name == "zb-h1" else None, virtual_stages=v)
    assert timeline.bubble_fraction == pytest.approx(_bubble(name, p, m, v), abs=1e-12)
    assert timeline.peak_in_flight == [_peak(name, p, m, s, v) for s in range(p)]


@pytest.mark.parametrize("p,m,v", [(1, 3, 2), (2, 3, 1), (4, 5, 3)])
def test_forward_only_runs_every_chunk_once_without_deadlock(p, m, v):
    schedule = [forward_only(m, p, s, v) for s in range(p)]
    assert all(sorted((a.micro, a.chunk) for a in row) == [(i, c) for i in range(m) for c in range(v)]
               for row in schedule)
    assert all(a.kind == "F" for row in schedule for a in row)
    simulate(schedule, virtual_stages=v)  # raises on a deadlock


def test_zero_bubble_beats_one_f_one_b_at_the_same_memory():
    zb = simulate(build("zb-h1", 8, 4), t_weight=1.0)
    base = simulate(build("1f1b", 8, 4))
    assert zb.makespan < base.makespan
    assert max(zb.peak_in_flight) == max(base.peak_in_flight)


def test_the_documented_one_f_one_b_order():
    assert format_schedule(build("1f1b", 8, 4)).splitlines()[0] == \
        "stage 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert str(one_f_one_b(2, 2, 1)) == "[F0, B0, F1, B1]"


def test_a_schedule_that_cannot_run_is_named():
    schedule = build("1f1b", 4, 2)
    schedule[1] = [Action("B", 0), *[a for a in schedule[1] if a != Action("B", 0)]]  # B0 before F0
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(schedule)
    with pytest.raises(ScheduleError, match="micro-batch 3 of chunk 0 is forwarded 0"):
        check([[a for a in build("gpipe", 4, 2)[0] if a != Action("F", 3)], build("gpipe", 4, 2)[1]], 4)


@pytest.mark.parametrize("call,message", [
    (lambda: build("interleaved", 6, 4, 2), "multiples of the 4 stages, got 6: use 8"),
    (lambda: build("1f1b", 4, 2, 2), "virtual_stages 2 needs the interleaved schedule"),
    (lambda: build("pipedream", 4, 2), "'pipedream' is not one of gpipe, 1f1b, interleaved, zb-h1"),
    (lambda: one_f_one_b(4, 2, 2), "stage_id 2 is not one of the 2 stages"),
    (lambda: one_f_one_b(0, 2, 0), "at least 1 stage and 1 micro-batch"),
])
def test_bad_arguments_say_what_would_be_right(call, message):
    with pytest.raises(ScheduleError, match=message):
        call()


@pytest.mark.parametrize("p,m", SIZES)
def test_an_input_half_right_before_its_weight_half_runs_as_one_backward(p, m):
    """ZB-H1's first stage runs each W right after its I: fused, it is 1F1B's first stage;
    every other stage keeps its split, and the fused plan is still complete and no slower."""
    plan = build("zb-h1", m, p)
    fused = [fuse_adjacent_halves(actions) for actions in plan]
    assert fused[0] == one_f_one_b(m, p, 0)
    assert fused[1:] == plan[1:]
    check(fused, m)
    assert simulate(fused, t_forward=1, t_backward=2, t_weight=1).makespan <= \
        simulate(plan, t_forward=1, t_backward=2, t_weight=1).makespan
    other = [Action("I", 0), Action("W", 1), Action("I", 1), Action("W", 0)]
    assert fuse_adjacent_halves(other) == other  # a W of another micro-batch is not fused
