"""`deepspeed.runtime.pipe.schedule` (meshspeed/compat/deepspeed/runtime/pipe/schedule.py):
DeepSpeed's instruction streams, derived from meshspeed's 1F1B and forward-only lists.
Small cases are written out by hand; larger ones are checked for the pairing of every
send with its receive in the same step."""

import pytest

from meshspeed.compat.deepspeed.runtime.pipe.schedule import (
    BackwardPass,
    DataParallelSchedule,
    ForwardPass,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)
from meshspeed.parallel.pipeline.schedule import ScheduleError

Load, Fwd, Bwd = LoadMicroBatch, ForwardPass, BackwardPass
END = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def test_train_two_stages_two_micro_batches_by_hand():
    # stage 0 runs F0 F1 B0 B1 at steps 0 2 3 5; stage 1 runs F0 B0 F1 B1 at steps 1 2 3 4
    assert list(TrainSchedule(micro_batches=2, stages=2, stage_id=0)) == [
        [Load(0), Fwd(0)],
        [SendActivation(0)],
        [Load(1), Fwd(1)],
        [RecvGrad(0), SendActivation(1), Bwd(0)],
        [],
        [RecvGrad(1), Bwd(1), *END],
    ]
    assert list(TrainSchedule(micro_batches=2, stages=2, stage_id=1)) == [
        [],
        [RecvActivation(0), Load(0), Fwd(0)],
        [Bwd(0)],
        [SendGrad(0), RecvActivation(1), Load(1), Fwd(1)],
        [Bwd(1)],
        [SendGrad(1), *END],
    ]


def test_train_one_stage_is_forward_backward_in_turn():
    assert list(TrainSchedule(micro_batches=2, stages=1, stage_id=0)) == [
        [Load(0), Fwd(0)], [Bwd(0)], [Load(1), Fwd(1)], [Bwd(1), *END]]


def test_train_middle_stage_of_three_by_hand():
    # 1F1B on stage 1 of 3 with 3 micro-batches: F0 F1 B0 F2 B1 B2 at steps 1 3 4 5 6 8
    sched = TrainSchedule(micro_batches=3, stages=3, stage_id=1)
    assert sched.num_pipe_buffers() == 2
    assert list(sched) == [
        [],
        [RecvActivation(0), Fwd(0)],
        [SendActivation(0)],
        [RecvActivation(1), Fwd(1)],
        [RecvGrad(0), SendActivation(1), Bwd(0)],
        [SendGrad(0), RecvActivation(0), Fwd(0)],
        [RecvGrad(1), SendActivation(0), Bwd(1)],
        [SendGrad(1)],
        [RecvGrad(0), Bwd(0)],
        [SendGrad(0), *END],
    ]


def test_inference_two_stages_three_micro_batches_by_hand():
    assert list(InferenceSchedule(micro_batches=3, stages=2, stage_id=0)) == [
        [Load(0), Fwd(0)],
        [Load(1), SendActivation(0), Fwd(1)],
        [Load(0), SendActivation(1), Fwd(0)],
        [SendActivation(0)],
    ]
    assert list(InferenceSchedule(micro_batches=3, stages=2, stage_id=1)) == [
        [],
        [Load(0), RecvActivation(0), Fwd(0)],
        [Load(1), RecvActivation(1), Fwd(1)],
        [Load(0), RecvActivation(0), Fwd(0)],
    ]


def test_inference_odd_stage_receives_before_it_sends():
    steps = list(InferenceSchedule(micro_batches=2, stages=3, stage_id=1))
    assert steps[2] == [RecvActivation(1), SendActivation(0), Fwd(1)]


def _count(steps, cls):
    return [sum(type(c) is cls for c in step) for step in steps]


@pytest.mark.parametrize("m,p", [(1, 2), (4, 3), (8, 4), (3, 5)])
def test_every_send_meets_its_receive_in_the_same_step(m, p):
    train = [list(TrainSchedule(m, p, s)) for s in range(p)]
    infer = [list(InferenceSchedule(m, p, s)) for s in range(p)]
    for streams in (train, infer):
        assert len({len(x) for x in streams}) == 1
        for s in range(p - 1):
            assert _count(streams[s], SendActivation) == _count(streams[s + 1], RecvActivation)
            assert sum(_count(streams[s], SendActivation)) == m
    for s in range(p - 1):
        assert _count(train[s + 1], SendGrad) == _count(train[s], RecvGrad)
    for s in range(p):  # each micro-batch forwarded and backwarded once, buffers in range
        assert sum(_count(train[s], ForwardPass)) == sum(_count(train[s], BackwardPass)) == m
        buffers = TrainSchedule(m, p, s).num_pipe_buffers()
        assert buffers == max(2, min(p - s, m))
        assert all(0 <= c.buffer_id < buffers for step in train[s] for c in step if hasattr(c, "buffer_id"))


def test_instructions_compare_by_class_and_arguments():
    assert Fwd(1) == Fwd(1) and Fwd(1) != Fwd(0) and Fwd(1) != Bwd(1)
    assert len({Fwd(1), Fwd(1), Load(1)}) == 2
    assert repr(SendGrad(3)) == "SendGrad(buffer_id=3)" and Fwd(2).buffer_id == 2


def test_schedule_queries_and_iteration_restart():
    sched = DataParallelSchedule(micro_batches=2, stages=1, stage_id=0)
    assert list(sched) == list(sched) == [[Load(0), Fwd(0), Bwd(0)], [Load(0), Fwd(0), Bwd(0), ReduceGrads(),
                                                                       OptimizerStep()]]
    sched = TrainSchedule(micro_batches=4, stages=3, stage_id=2)
    assert (sched.stage, sched.num_stages, sched.num_micro_batches) == (2, 3, 4)
    assert sched.is_last_stage and not sched.is_first_stage


@pytest.mark.parametrize("args", [(0, 2, 0), (4, 2, 2), (4, 0, 0), (4, 2, -1)])
def test_bad_sizes_are_refused(args):
    with pytest.raises(ScheduleError):
        TrainSchedule(*args)
