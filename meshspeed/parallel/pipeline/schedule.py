"""Pipeline schedules as data: what each stage does, in order, for one batch.

    one_f_one_b(micro_batches=8, stages=4, stage_id=0)
    -> [F0, F1, F2, F3, B0, F4, B1, F5, B2, F6, B3, F7, B4, B5, B6, B7]

A schedule is a function `(micro_batches, stages, stage_id[, virtual_stages]) -> [Action]`.
An action runs one micro-batch through one model chunk on this stage: "F" forward, "B" the
whole backward, or, for schedules that split the backward (zero-bubble, arXiv:2401.10241),
"I" the input-gradient half and "W" the weight-gradient half. `chunk` is the model chunk
on this stage (interleaved schedules hold `virtual_stages` chunks per stage; chunk c of
stage s is virtual stage c * stages + s). The runtime executes the list in order and
exchanges activations and gradients with the neighbouring stages; nothing here knows
about processes, so every schedule is checked (`check`) and timed (`simulate`) in a unit
test.

Note [schedules and their bounds]
With p stages, m micro-batches, and forward and backward taking t_F and t_B:
  GPipe (arXiv:1811.06965)   every forward, then every backward. m micro-batches in
                             flight per stage; bubble (p-1)/(m+p-1) of the step.
  1F1B (PipeDream-flush, arXiv:2104.04473, Section 2.2)
                             stage s runs p-s-1 warm-up forwards, then alternates one
                             forward and one backward, then drains the backwards. At most
                             p-s micro-batches in flight (p on stage 0); same bubble as
                             GPipe.
  interleaved 1F1B (arXiv:2104.04473, Section 2.2)
                             v chunks per stage, each 1/v of a stage's layers; m must be
                             a multiple of p. Warm-up (p-s-1)*2 + (v-1)*p chunk forwards.
                             The bubble shrinks by v: (p-1)/(v*m + p-1) of the step.
  ZB-H1 (arXiv:2401.10241, Section 3)
                             1F1B with each backward split into I (input gradient, what
                             the previous stage waits for) and W (weight gradient, which
                             nobody waits for). Stage s runs its W passes s micro-batches
                             late: they fill the cool-down, and every stage holds at most p
                             micro-batches (1F1B's peak, on its first stage). With
                             t_F = t_I = t_W the bubble is (p-1)/(3m + p-1), a third of 1F1B's
                             (its paper: (p-1)(t_F + t_I - t_W)).
All four figures are what `simulate` measures on these lists (tests/parallel/pipeline).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "B", "I", "W"


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B", "I" or "W"
    micro: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")

    __repr__ = __str__


class ScheduleError(ValueError):
    """A schedule asked for what it cannot do (too few micro-batches, a bad stage id)."""


def _check_args(micro_batches: int, stages: int, stage_id: int) -> None:
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(f"a pipeline needs at least 1 stage and 1 micro-batch, got "
                            f"{stages} stage(s) and {micro_batches} micro-batch(es)")
    if not 0 <= stage_id < stages:
        raise ScheduleError(f"stage_id {stage_id} is not one of the {stages} stages 0..{stages - 1}")


def gpipe(micro_batches: int, stages: int, stage_id: int) -> list[Action]:
    """Every forward, then every backward (in the same micro-batch order)."""
    _check_args(micro_batches, stages, stage_id)
    return ([Action(FORWARD, i) for i in range(micro_batches)]
            + [Action(BACKWARD, i) for i in range(micro_batches)])


def one_f_one_b(micro_batches: int, stages: int, stage_id: int) -> list[Action]:
    """Warm-up forwards, then one forward and one backward in turn, then the last backwards."""
    _check_args(micro_batches, stages, stage_id)
    warmup = min(stages - stage_id - 1, micro_batches)
    out = [Action(FORWARD, i) for i in range(warmup)]
    for j in range(micro_batches - warmup):
        out += [Action(FORWARD, warmup + j), Action(BACKWARD, j)]
    out += [Action(BACKWARD, j) for j in range(micro_batches - warmup, micro_batches)]
    return out


def interleaved(micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 2) -> list[Action]:
    """Interleaved 1F1B over `virtual_stages` model chunks per stage (Note [schedules and
    their bounds]): micro-batches go through the chunks in groups of `stages`."""
    _check_args(micro_batches, stages, stage_id)
    v, p, m = virtual_stages, stages, micro_batches
    if v < 1:
        raise ScheduleError(f"virtual_stages must be at least 1, got {v}")
    if v > 1 and m % p:
        raise ScheduleError(f"the interleaved schedule needs micro-batches in multiples of the "
                            f"{p} stages, got {m}: use {-(-m // p) * p}, or the 1f1b schedule")
    total = m * v

    def nth(k: int, kind: str) -> Action:
        group, within = divmod(k, p * v)
        chunk = (k // p) % v
        if kind == BACKWARD:
            chunk = v - 1 - chunk
        return Action(kind, group * p + within % p, chunk)

    warmup = min((p - stage_id - 1) * 2 + (v - 1) * p, total) if v > 1 else min(p - stage_id - 1, total)
    out = [nth(k, FORWARD) for k in range(warmup)]
    for j in range(total - warmup):
        out += [nth(warmup + j, FORWARD), nth(j, BACKWARD)]
    out += [nth(j, BACKWARD) for j in range(total - warmup, total)]
    return out


def zb_h1(micro_batches: int, stages: int, stage_id: int) -> list[Action]:
    """Zero-bubble ZB-H1 (Note [schedules and their bounds]): 1F1B with the backward split
    into its input half "I" (on the critical path) and weight half "W"; stage s runs each
    W `s` micro-batches late, so the W passes fill the cool-down bubble."""
    _check_args(micro_batches, stages, stage_id)
    m, delay = micro_batches, stage_id
    warmup = min(stages - stage_id - 1, m)
    out = [Action(FORWARD, i) for i in range(warmup)]
    weights = 0  # W passes issued so far, in micro-batch order

    def weight_due(j: int) -> None:
        nonlocal weights
        if j - delay >= weights:
            out.append(Action(WEIGHT_GRAD, weights))
            weights += 1

    for j in range(m - warmup):
        out += [Action(FORWARD, warmup + j), Action(INPUT_GRAD, j)]
        weight_due(j)
    for j in range(m - warmup, m):
        out.append(Action(INPUT_GRAD, j))
        weight_due(j)
    out += [Action(WEIGHT_GRAD, i) for i in range(weights, m)]
    return out


def forward_only(micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 1) -> list[Action]:
    """Forwards only, for evaluation: every micro-batch through chunk 0, then through chunk 1,
    and so on. A forward waits only on an earlier virtual stage, which runs it earlier in
    its own list, so this cannot deadlock, for any number of micro-batches."""
    _check_args(micro_batches, stages, stage_id)
    if virtual_stages < 1:
        raise ScheduleError(f"virtual_stages must be at least 1, got {virtual_stages}")
    return [Action(FORWARD, i, c) for c in range(virtual_stages) for i in range(micro_batches)]


SCHEDULES: dict[str, Callable[..., list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
}


def build(name: str, micro_batches: int, stages: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Every stage's actions for the schedule called `name` (the config's pipeline.schedule)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"pipeline.schedule {name!r} is not one of {', '.join(SCHEDULES)}")
    make = SCHEDULES[name]
    if name == "interleaved":
        return [make(micro_batches, stages, s, virtual_stages) for s in range(stages)]
    if virtual_stages != 1:
        raise ScheduleError(f"pipeline.virtual_stages {virtual_stages} needs the interleaved schedule, "
                            f"not {name!r}")
    return [make(micro_batches, stages, s) for s in range(stages)]


def fuse_adjacent_halves(actions: list[Action]) -> list[Action]:
    """`actions` (one stage's) with each input half I that is immediately followed by its
    own weight half W written as one whole backward B (Note [an I right before its W is a B])."""
    out: list[Action] = []
    for a in actions:
        prev = out[-1] if out else None
        if (a.kind == WEIGHT_GRAD and prev is not None and prev.kind == INPUT_GRAD
                and (prev.micro, prev.chunk) == (a.micro, a.chunk)):
            out[-1] = Action(BACKWARD, a.micro, a.chunk)
        else:
            out.append(a)
    return out


# Note [an I right before its W is a B]
# A backward is split so that its weight half can wait while other passes run. Where a
# schedule runs a W right after its own I (every backward of ZB-H1's first stage, whose W
# delay is 0), nothing runs between them and the split only costs: the forward's capture,
# the (x, dy) pairs it keeps, and its Python autograd nodes. The runtime runs such a pair
# as one ordinary backward: the same GEMMs, the same order of the stage's work, and the
# gradient the previous stage waits for (there is none on stage 0) is no later.


# -- checking and timing -------------------------------------------------------------------------
def virtual_stage(action: Action, stage_id: int, stages: int) -> int:
    return action.chunk * stages + stage_id


def check(schedule: list[list[Action]], micro_batches: int, virtual_stages: int = 1) -> None:
    """Raise ScheduleError unless every micro-batch is forwarded and backwarded exactly once
    per virtual stage (a whole backward, or its input and weight halves)."""
    for s, actions in enumerate(schedule):
        seen = [(a.kind, a.micro, a.chunk) for a in actions]
        if len(seen) != len(set(seen)):
            raise ScheduleError(f"stage {s}: an action appears twice")
        for c in range(virtual_stages):
            for i in range(micro_batches):
                f, b = seen.count((FORWARD, i, c)), seen.count((BACKWARD, i, c))
                halves = seen.count((INPUT_GRAD, i, c)), seen.count((WEIGHT_GRAD, i, c))
                if f != 1 or not (b == 1 and halves == (0, 0) or b == 0 and halves == (1, 1)):
                    raise ScheduleError(f"stage {s}: micro-batch {i} of chunk {c} is forwarded {f} "
                                        f"time(s) and backwarded {b} (+{halves[0]} input, "
                                        f"{halves[1]} weight halves); each must be once")
        if len(seen) != 2 * micro_batches * virtual_stages + sum(a.kind == WEIGHT_GRAD for a in actions):
            raise ScheduleError(f"stage {s}: actions for micro-batches or chunks that do not exist")


@dataclass
class Timeline:
    """`simulate`'s result: each action's (start, end) per stage, and what it adds up to."""

    spans: list[list[tuple[Action, float, float]]]
    makespan: float
    busy: list[float]
    peak_in_flight: list[int]  # micro-batch activations held at once, per stage

    @property
    def bubble_fraction(self) -> float:
        stages = len(self.spans)
        return 1 - sum(self.busy) / (stages * self.makespan)


def simulate(schedule: list[list[Action]], *, t_forward: float = 1.0, t_backward: float = 2.0,
             t_weight: float | None = None, virtual_stages: int = 1) -> Timeline:
    """Run the per-stage lists as a pipeline would, with no communication cost: an action
    starts when its stage is free and what it depends on is done (a forward on the previous
    virtual stage's forward of the micro-batch, a backward on the next virtual stage's
    backward and on its own forward). `t_backward` is a whole backward; with `t_weight`,
    "I" takes t_backward - t_weight and "W" t_weight. Raises ScheduleError on a deadlock."""
    stages = len(schedule)
    last = virtual_stages * stages - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro, virtual stage) -> end time
    cost = {FORWARD: t_forward / virtual_stages, BACKWARD: t_backward / virtual_stages}
    if t_weight is not None:
        cost[INPUT_GRAD] = (t_backward - t_weight) / virtual_stages
        cost[WEIGHT_GRAD] = t_weight / virtual_stages
    position = [0] * stages
    free = [0.0] * stages
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(stages)]
    live = [0] * stages
    peak = [0] * stages

    def ready(a: Action, s: int) -> float | None:
        """When `a`'s inputs are there (None: not yet)."""
        g = virtual_stage(a, s, stages)
        needs: list[float | None] = []
        if a.kind == FORWARD and g > 0:
            needs.append(done.get((FORWARD, a.micro, g - 1)))
        if a.kind in (BACKWARD, INPUT_GRAD):
            needs.append(done.get((FORWARD, a.micro, g)))
            if g < last:  # the output gradient: the next virtual stage's backward or input half
                up = done.get((BACKWARD, a.micro, g + 1), done.get((INPUT_GRAD, a.micro, g + 1)))
                needs.append(up)
        if a.kind == WEIGHT_GRAD:
            needs.append(done.get((INPUT_GRAD, a.micro, g)))
        if any(t is None for t in needs):
            return None
        return max(needs, default=0.0)

    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for s in range(stages):
            if position[s] == len(schedule[s]):
                continue
            a = schedule[s][position[s]]
            t = ready(a, s)
            if t is None:
                continue
            start = max(t, free[s])
            end = start + cost[a.kind]
            done[(a.kind, a.micro, virtual_stage(a, s, stages))] = end
            spans[s].append((a, start, end))
            free[s] = end
            position[s] += 1
            remaining -= 1
            progressed = True
            if a.kind == FORWARD:
                live[s] += 1
                peak[s] = max(peak[s], live[s])
            elif a.kind in (BACKWARD, WEIGHT_GRAD):
                live[s] -= 1
        if not progressed:
            stuck = {s: str(schedule[s][position[s]]) for s in range(stages) if position[s] < len(schedule[s])}
            raise ScheduleError(f"the schedule deadlocks: each stage waits on its next action {stuck}")
    makespan = max(free)
    busy = [sum(e - b for _, b, e in row) for row in spans]
    return Timeline(spans, makespan, busy, peak)


def format_schedule(schedule: list[list[Action]]) -> str:
    """One line per stage: `stage 0: F0 F1 B0 ...`."""
    return "\n".join(f"stage {s}: " + " ".join(map(str, actions)) for s, actions in enumerate(schedule))
