"""A schedule's actions placed on one clock shared by all stages: step by step, who runs what.

    place(build("1f1b", micro_batches=4, stages=2))
    -> [[F0, None, F1, B0, F2, B1, F3, B2, None, B3],   stage 0
        [None, F0, B0, F1, B1, F2, B2, F3, B3, None]]   stage 1

`schedule.py` gives each stage its actions in order and nothing more: the runtime runs them
as soon as their inputs arrive. Some consumers want the pipeline in lock step instead: a
sequence of steps in which every stage does at most one action, and every message crosses
between two consecutive steps (DeepSpeed's instruction streams, `TrainSchedule`, are this
view of the 1F1B list). `place` computes it from the per-stage lists; it decides no order of
its own.

Note [forward steps and backward steps alternate]
With backwards in the schedule, the steps of stage s alternate between forward steps (those
of s's parity) and backward steps (the others), so in every step two neighbouring stages do
different kinds: one of them can send while the other receives, in the same step, without
both blocking on a send. Each action goes to the earliest step of its kind that is after
the stage's previous action and after the step of the action it needs (the previous
stage's forward of the micro-batch, the next stage's backward of it). A forward-only
schedule has only forward steps. With m micro-batches on p stages, 1F1B placed this way
takes 2(m + p - 1) steps (every stage's list is as long), forward-only m + p - 1, and a
message produced in step t is consumed in step t + 1: F_i of stage s is in step 2i + s,
B_i in step 2i + 2p - s - 1.
"""

from __future__ import annotations

from meshspeed.parallel.pipeline.schedule import BACKWARD, FORWARD, Action, ScheduleError

Placed = list[list[Action | None]]


def place(schedule: list[list[Action]]) -> Placed:
    """Every stage's actions on the shared clock (Note [forward steps and backward steps
    alternate]): `placed[s][t]` is what stage s runs in step t, None for nothing; every
    stage's list has the same length, the step after the last action of any stage."""
    stages = len(schedule)
    kinds = {a.kind for actions in schedule for a in actions}
    if kinds - {FORWARD, BACKWARD} or any(a.chunk for actions in schedule for a in actions):
        raise ScheduleError("a lock-step placement takes whole forwards and backwards (F, B) of one "
                            f"chunk per stage; this schedule has {sorted(kinds)} actions"
                            + (" on several chunks" if any(a.chunk for r in schedule for a in r) else ""))
    alternate = BACKWARD in kinds
    step: dict[tuple[str, int, int], int] = {}  # (kind, micro, stage) -> its step
    position = [0] * stages
    last = [-1] * stages  # the step of each stage's previous action
    remaining = sum(len(actions) for actions in schedule)
    while remaining:
        progressed = False
        for s in range(stages):
            if position[s] == len(schedule[s]):
                continue
            a = schedule[s][position[s]]
            neighbour = s - 1 if a.kind == FORWARD else s + 1
            after = last[s]
            if 0 <= neighbour < stages:
                needed = step.get((a.kind, a.micro, neighbour))
                if needed is None:
                    continue  # the neighbour has not placed it yet
                after = max(after, needed)
            t = after + 1
            if alternate and (t % 2 == s % 2) != (a.kind == FORWARD):
                t += 1  # Note [forward steps and backward steps alternate]
            step[(a.kind, a.micro, s)] = last[s] = t
            position[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            stuck = {s: str(schedule[s][position[s]]) for s in range(stages) if position[s] < len(schedule[s])}
            raise ScheduleError(f"the schedule deadlocks: each stage waits on its next action {stuck}")
    length = max(last, default=-1) + 1
    placed: Placed = [[None] * length for _ in range(stages)]
    for (kind, micro, s), t in step.items():
        placed[s][t] = Action(kind, micro)
    return placed


def peak_in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose forward has run and whose backward has not, at once:
    how many activations a stage keeps (a forward-only list: every forward it runs)."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == FORWARD else -1 if a.kind == BACKWARD else 0
        peak = max(peak, live)
    return peak
