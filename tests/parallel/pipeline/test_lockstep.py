"""The lock-step placement of schedules (meshspeed/parallel/pipeline/lockstep.py): 1F1B on
the shared clock is F_i at step 2i + s and B_i at 2i + 2p - s - 1 on every stage, each
message consumed one step after it is produced, and what cannot be placed is refused."""

import pytest

from meshspeed.parallel.pipeline.lockstep import peak_in_flight, place
from meshspeed.parallel.pipeline.schedule import (
    Action,
    ScheduleError,
    build,
    forward_only,
    one_f_one_b,
)


def test_two_stages_four_micro_batches_by_hand():
    F, B = (lambda i: Action("F", i)), (lambda i: Action("B", i))
    assert place(build("1f1b", 4, 2)) == [
        [F(0), None, F(1), B(0), F(2), B(1), F(3), B(2), None, B(3)],
        [None, F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3), None],
    ]


@pytest.mark.parametrize("m,p", [(1, 1), (1, 3), (2, 4), (5, 3), (8, 4), (3, 6)])
def test_one_f_one_b_steps_follow_the_closed_form(m, p):
    placed = place(build("1f1b", m, p))
    for s, row in enumerate(placed):
        assert len(row) == 2 * (m + p - 1)
        assert [a for a in row if a is not None] == one_f_one_b(m, p, s)  # the list's own order
        for t, a in enumerate(row):
            if a is not None:
                assert t == (2 * a.micro + s if a.kind == "F" else 2 * a.micro + 2 * p - s - 1)


def test_forward_only_takes_one_step_per_micro_batch_and_stage():
    placed = place([forward_only(3, 3, s) for s in range(3)])
    assert [[None if a is None else a.micro for a in row] for row in placed] == [
        [0, 1, 2, None, None], [None, 0, 1, 2, None], [None, None, 0, 1, 2]]


def test_split_backwards_and_chunks_are_refused():
    with pytest.raises(ScheduleError, match="F, B"):
        place(build("zb-h1", 4, 2))
    with pytest.raises(ScheduleError, match="chunk"):
        place(build("interleaved", 4, 2, 2))


def test_a_deadlocking_schedule_is_an_error():
    with pytest.raises(ScheduleError, match="deadlocks"):
        place([[Action("B", 0), Action("F", 0)], [Action("F", 0), Action("B", 0)]])


def test_peak_in_flight_is_the_1f1b_bound():
    assert [peak_in_flight(one_f_one_b(8, 4, s)) for s in range(4)] == [4, 3, 2, 1]
    assert peak_in_flight(one_f_one_b(2, 4, 0)) == 2
