"""``deepspeed.runtime.pipe.schedule``: DeepSpeed's pipeline schedules, as instruction streams.

    for cmds in TrainSchedule(micro_batches=4, stages=2, stage_id=0):
        ...   # [LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0)], [], ...

DeepSpeed's engine executes a schedule as a list of instructions per step (load a micro-
batch into a buffer, run a forward on it, send or receive an activation or a gradient,
...). meshspeed's schedules are lists of actions per stage (meshspeed/parallel/pipeline/
schedule.py) and its runtime derives the messages itself; this module is the DeepSpeed
view of them: `TrainSchedule` is meshspeed's 1F1B list and `InferenceSchedule` its
forward-only list, both placed on the lock-step clock of meshspeed/parallel/pipeline/
lockstep.py, each step's action turned into DeepSpeed's instructions.

Note [DeepSpeed's streams from meshspeed's lists]
DeepSpeed's TrainSchedule runs, on every stage, exactly meshspeed's 1F1B order (p - s - 1
warm-up forwards, then one forward and one backward in turn); what its stream adds is the
clock and the messages. On the clock of `lockstep.place`, step t of stage s holds at most
one action, and a stage's step is a forward step or a backward step (they alternate). A
step's instructions are, in this order:
  forward step:  SendGrad of the previous step's backward (if there is a previous stage),
                 RecvActivation of this step's micro-batch (likewise), LoadMicroBatch
                 (first and last stages), ForwardPass;
  backward step: RecvGrad of this step's micro-batch (if there is a next stage),
                 SendActivation of the previous step's forward (likewise), BackwardPass;
and the batch's last step ends with ReduceTiedGrads, ReduceGrads, OptimizerStep. A stage
sends first in its forward steps and receives first in its backward steps, so each pair of
neighbours (in different kinds of step) pairs its blocking sends and receives in order.
Inference has only forward steps: a stage loads (first and last stages), then sends the
previous step's output and receives this step's input (stages of even index send first,
odd ones receive first), then runs the forward. Micro-batch i lives in buffer
i % num_pipe_buffers(): the most micro-batches a stage holds at once (at least 2, so the
output still being sent and the input being received never share one); 2 for inference.

Instructions compare equal when they are of the same class with the same arguments
(DeepSpeed's compare by identity), so streams can be compared as lists.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from meshspeed.parallel.pipeline.lockstep import peak_in_flight, place
from meshspeed.parallel.pipeline.schedule import ScheduleError, build, forward_only, one_f_one_b

__all__ = [
    "BackwardPass", "BufferOpInstruction", "DataParallelSchedule", "ForwardPass", "InferenceSchedule",
    "LoadMicroBatch", "OptimizerStep", "PipeInstruction", "PipeSchedule", "RecvActivation", "RecvGrad",
    "ReduceGrads", "ReduceTiedGrads", "SendActivation", "SendGrad", "TrainSchedule",
]

Step = list["PipeInstruction"]


# -- instructions ----------------------------------------------------------------------------------
class PipeInstruction:
    """One thing an engine does; its keyword arguments are its attributes (`buffer_id`)."""

    def __init__(self, **kwargs: Any):
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PipeInstruction):
            return NotImplemented
        return type(self) is type(other) and self.kwargs == other.kwargs

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after ReduceTiedGrads and ReduceGrads)."""


class ReduceGrads(PipeInstruction):
    """Reduce the stage's gradients over its data-parallel ranks."""


class ReduceTiedGrads(PipeInstruction):
    """Sum the gradients of tied layers over the stages holding them."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on one of the stage's pipeline buffers."""

    def __init__(self, buffer_id: int, **kwargs: Any):
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Read the next micro-batch from the data iterator into a buffer."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's layers on a buffer's input."""


class BackwardPass(BufferOpInstruction):
    """Backpropagate a buffer's output gradient through the stage's layers."""


class SendActivation(BufferOpInstruction):
    """Send a buffer's output to the next stage (paired with its RecvActivation)."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's output into a buffer (paired with its SendActivation)."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of a buffer's input to the previous stage (paired with its RecvGrad)."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of a buffer's output from the next stage (paired with its SendGrad)."""


# -- schedules -------------------------------------------------------------------------------------
def _whole(value: Any, what: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ScheduleError(f"{what}={value!r}: an integer of at least {least}")
    return value


class PipeSchedule(ABC):
    """A stage's instructions for one batch, step by step: iterate it, or define `steps()`
    in a subclass to write a schedule of your own."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        super().__init__()
        self.micro_batches = _whole(micro_batches, "micro_batches", 1)
        self.stages = _whole(stages, "stages", 1)
        self.stage_id = _whole(stage_id, "stage_id", 0)
        if stage_id >= stages:
            raise ScheduleError(f"stage_id {stage_id} is not one of the {stages} stages 0..{stages - 1}")
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1
        self.it: Iterator[Step] | None = None

    @abstractmethod
    def steps(self) -> Iterator[Step]:
        """Yield each step's instructions."""

    def num_pipe_buffers(self) -> int:
        """How many buffers the stage needs (one per micro-batch unless a schedule says less)."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        """The buffer micro-batch `micro_batch_id` lives in (they are used in turn)."""
        if not self._valid_micro_batch(micro_batch_id):
            raise ScheduleError(f"micro-batch {micro_batch_id} is not one of the {self.micro_batches} "
                                f"micro-batches 0..{self.micro_batches - 1}")
        return micro_batch_id % self.num_pipe_buffers()

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def __iter__(self) -> PipeSchedule:
        self.it = None  # each iteration starts from the first step
        return self

    def __next__(self) -> Step:
        if self.it is None:
            self.it = iter(self.steps())
        return next(self.it)


class TrainSchedule(PipeSchedule):
    """1F1B training (meshspeed's "1f1b" schedule) as DeepSpeed's instruction stream
    (Note [DeepSpeed's streams from meshspeed's lists])."""

    def steps(self) -> Iterator[Step]:
        mine = place(build("1f1b", self.micro_batches, self.stages))[self.stage_id]
        has_prev, has_next = self._valid_stage(self.prev_stage), self._valid_stage(self.next_stage)
        loads = self.is_first_stage or self.is_last_stage
        for t, action in enumerate(mine):
            before = mine[t - 1] if t else None
            cmds: Step = []
            if (t - self.stage_id) % 2 == 0:  # a forward step: send first
                if before is not None and has_prev:
                    cmds.append(SendGrad(self._buffer_idx(before.micro)))
                if action is not None:
                    buffer = self._buffer_idx(action.micro)
                    if has_prev:
                        cmds.append(RecvActivation(buffer))
                    if loads:
                        cmds.append(LoadMicroBatch(buffer))
                    cmds.append(ForwardPass(buffer))
            else:  # a backward step: receive first
                if action is not None and has_next:
                    cmds.append(RecvGrad(self._buffer_idx(action.micro)))
                if before is not None and has_next:
                    cmds.append(SendActivation(self._buffer_idx(before.micro)))
                if action is not None:
                    cmds.append(BackwardPass(self._buffer_idx(action.micro)))
            if t == len(mine) - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        """The micro-batches the stage holds at once under 1F1B, min(stages - stage_id,
        micro_batches), and at least 2."""
        return max(2, peak_in_flight(one_f_one_b(self.micro_batches, self.stages, self.stage_id)))


class InferenceSchedule(PipeSchedule):
    """Forwards only (meshspeed's forward-only list) as DeepSpeed's instruction stream
    (Note [DeepSpeed's streams from meshspeed's lists])."""

    def steps(self) -> Iterator[Step]:
        lists = [forward_only(self.micro_batches, self.stages, s) for s in range(self.stages)]
        mine = place(lists)[self.stage_id]
        has_prev, has_next = self._valid_stage(self.prev_stage), self._valid_stage(self.next_stage)
        for t, action in enumerate(mine):
            before = mine[t - 1] if t else None
            cmds: Step = []
            if action is not None and (self.is_first_stage or self.is_last_stage):
                cmds.append(LoadMicroBatch(self._buffer_idx(action.micro)))
            send = [SendActivation(self._buffer_idx(before.micro))] if before is not None and has_next else []
            recv = [RecvActivation(self._buffer_idx(action.micro))] if action is not None and has_prev else []
            cmds += send + recv if self.stage_id % 2 == 0 else recv + send
            if action is not None:
                cmds.append(ForwardPass(self._buffer_idx(action.micro)))
            yield cmds

    def num_pipe_buffers(self) -> int:
        """Two: the output being sent and the input being received."""
        return 2


class DataParallelSchedule(PipeSchedule):
    """No pipeline: each micro-batch loaded, forwarded and backwarded in one buffer, then
    the reduction and the optimizer step (gradient accumulation)."""

    def steps(self) -> Iterator[Step]:
        for i in range(self.micro_batches):
            cmds: Step = [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]
            if i == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1

